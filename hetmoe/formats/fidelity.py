"""Round-trip fidelity of every codec on one tensor: the table ``hetmoe demo`` prints.

``STANDARD_SET`` lists the method configurations people use, each with the SNR floor (dB) it must
reach on the built-in example tensor (Gaussian, N=K=1024, seed 0); a floor that fails means a
codec regressed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from .base import snr_db
from .registry import get_codec

EXAMPLE_SHAPE = (1024, 1024)
EXAMPLE_SEED = 0

# (method, params, floor in dB on the example tensor)
STANDARD_SET: list[tuple[str, dict[str, Any], float]] = [
    ("bf16", {}, 45.0),
    ("fp8", {}, 25.0),
    ("fp8-channel", {}, 25.0),
    ("int8", {}, 38.0),
    ("int4", {"group_size": 32}, 19.0),
    ("int4", {"group_size": 64}, 18.0),
    ("int4", {"group_size": 128}, 17.0),
    ("int4", {"group_size": 32, "layout": "compressed-tensors"}, 19.0),
    ("int4-asym", {"group_size": 32}, 20.0),
    ("gptq", {"group_size": 128}, 17.0),
    ("gptq", {"group_size": 128, "sym": False, "checkpoint_format": "gptq_v2"}, 17.0),
    ("mxfp4", {}, 14.0),
    ("gguf:q8_0", {}, 38.0),
    ("gguf:q6_k", {}, 28.0),
    ("gguf:q5_k", {}, 23.0),
    ("gguf:q4_k", {}, 17.0),
    ("gguf:q4_0", {}, 16.0),
    ("gguf:iq4_xs", {}, 18.0),
    ("gguf:mxfp4", {}, 14.0),
]


@dataclass
class FidelityRow:
    label: str
    method: str
    snr_db: float
    bits_per_weight: float
    floor_db: float
    seconds: float

    @property
    def ok(self) -> bool:
        return self.snr_db >= self.floor_db


def example_weight(shape: tuple[int, int] = EXAMPLE_SHAPE, seed: int = EXAMPLE_SEED) -> torch.Tensor:
    """The built-in example tensor: standard Gaussian, fixed seed, float32."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def fidelity_table(weight: torch.Tensor | None = None) -> list[FidelityRow]:
    """Quantize, validate and dequantize ``weight`` with every configuration of ``STANDARD_SET``."""
    w = example_weight() if weight is None else weight
    rows = []
    for method, params, floor in STANDARD_SET:
        codec = get_codec(method, **params)
        start = time.perf_counter()
        q = codec.quantize(w)
        codec.validate(q)
        back = codec.dequantize(q)
        elapsed = time.perf_counter() - start
        rows.append(
            FidelityRow(codec.label(), method, snr_db(w, back), codec.bits_per_weight(tuple(w.shape)), floor, elapsed)
        )
    return rows


def format_table(rows: list[FidelityRow]) -> str:
    lines = [f"{'method':36s} {'bits/w':>7s} {'SNR dB':>7s} {'floor':>6s}  {'ok':3s} {'ms':>7s}"]
    for r in rows:
        mark = "yes" if r.ok else "NO"
        ms = r.seconds * 1e3
        lines.append(f"{r.label:36s} {r.bits_per_weight:7.3f} {r.snr_db:7.2f} {r.floor_db:6.1f}  {mark:3s} {ms:7.1f}")
    return "\n".join(lines)
