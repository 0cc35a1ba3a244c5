"""Check a written GPTQ checkpoint by reading it back, decoding by the convention alone.

The decoder here is deliberately independent of the codec that wrote the files: it opens the
shards with the ``safetensors`` library (not hetmoe's reader nor the writer's buffers) and
unpacks with integer shifts on the int32 words (the codec views bytes), following the
AutoGPTQ / vLLM rule as published:

    code(k, n)   = (qweight[k // 8, n] >> 4 * (k % 8)) & 0xF
    stored(g, n) = (qzeros[g, n // 8] >> 4 * (n % 8)) & 0xF;  z = stored + 1 (v1 "gptq"), stored (v2)
    w(n, k)      = (code(k, n) - z(g_idx[k], n)) * scales[g_idx[k], n]

with the symmetric case held to vLLM's ``uint4b8`` (z = 8 whatever qzeros says) after checking
that qzeros holds the classic constant, and ``g_idx[k] = k // group_size`` (no act-order).
Each decoded weight is compared with the source's and must reach the SNR the quantizer reported.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..formats.base import snr_db
from .safetensors_stream import INDEX_FILE, SINGLE_FILE

TOLERANCE_DB = 0.01
SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


class GPTQDecodeError(ValueError):
    """The stored tensors break the convention (shapes, dtypes, g_idx, constant zeros)."""


def decode_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    sym: bool,
    checkpoint_format: str,
    group_size: int,
    name: str = "weight",
) -> torch.Tensor:
    """The weight ``[N, K]`` (float32) the stored tensors mean, by the published rule."""
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or g_idx.dtype != torch.int32:
        raise GPTQDecodeError(f"{name}: qweight, qzeros and g_idx must be int32")
    if scales.dtype != torch.float16:
        raise GPTQDecodeError(f"{name}: scales must be float16, found {scales.dtype}")
    k8, n = qweight.shape
    k = 8 * k8
    g = k if group_size == -1 else group_size
    if tuple(scales.shape) != (k // g, n) or tuple(qzeros.shape) != (k // g, n // 8) or tuple(g_idx.shape) != (k,):
        raise GPTQDecodeError(
            f"{name}: for K={k}, N={n}, g={g} expected scales {[k // g, n]}, qzeros {[k // g, n // 8]}, g_idx [{k}]; "
            f"found {list(scales.shape)}, {list(qzeros.shape)}, {list(g_idx.shape)}"
        )
    expected_gidx = torch.arange(k, dtype=torch.int32) // g
    if not torch.equal(g_idx, expected_gidx):
        raise GPTQDecodeError(f"{name}: g_idx is not k // {g} (act-order / desc_act is not part of this format)")
    shifts = (4 * torch.arange(8, dtype=torch.int32)).view(1, 8, 1)
    codes = ((qweight.unsqueeze(1) >> shifts) & 0xF).reshape(k, n)  # [K, N]
    stored = ((qzeros.unsqueeze(2) >> shifts.view(1, 1, 8)) & 0xF).reshape(k // g, n)  # [G, N]
    zeros = stored + 1 if checkpoint_format == "gptq" else stored
    if sym and not bool((zeros == 8).all()):
        raise GPTQDecodeError(
            f"{name}: a symmetric checkpoint must store the constant zero point 8 "
            f"({'0x77777777' if checkpoint_format == 'gptq' else '0x88888888'} per word)"
        )
    gk = g_idx.long()
    w_t = (codes - zeros[gk]).float() * scales.float()[gk]  # [K, N]
    return w_t.t().contiguous()


@dataclass
class VerifyResult:
    name: str
    reported_snr_db: float
    verified_snr_db: float

    @property
    def ok(self) -> bool:
        return self.verified_snr_db >= self.reported_snr_db - TOLERANCE_DB


def open_written(directory: Path) -> tuple[Callable[[str], torch.Tensor], set[str]]:
    """``get(name)`` over a written checkpoint's shards, through the safetensors library."""
    from safetensors import safe_open

    index = directory / INDEX_FILE
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(str(directory / SINGLE_FILE), framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
    handles: dict[str, Any] = {}

    def get(name: str) -> torch.Tensor:
        file = weight_map[name]
        if file not in handles:
            handles[file] = safe_open(str(directory / file), framework="pt")
        return handles[file].get_tensor(name)

    return get, set(weight_map)


def verify_written(
    directory: Path,
    expected: Iterable[tuple[str, Callable[[], torch.Tensor], float]],
    *,
    sym: bool,
    checkpoint_format: str,
    group_size: int,
) -> list[VerifyResult]:
    """Decode every ``(module, original weight loader, reported SNR)`` from ``directory``'s files."""
    get, names = open_written(directory)
    results = []
    for module, original, reported in expected:
        missing = [module + s for s in SUFFIXES if module + s not in names]
        if missing:
            raise GPTQDecodeError(f"{module}: the written checkpoint lacks {missing}")
        weight = decode_gptq(
            *(get(module + s) for s in SUFFIXES),
            sym=sym,
            checkpoint_format=checkpoint_format,
            group_size=group_size,
            name=module,
        )
        results.append(VerifyResult(module, reported, snr_db(original().float(), weight)))
    return results
