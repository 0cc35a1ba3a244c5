"""Group a checkpoint's tensors into weights and say which method each weight is stored in.

A quantized weight is several tensors under one module prefix (``q_proj.weight`` +
``q_proj.weight_scale_inv``; ``q_proj.qweight`` + ``qzeros`` + ``scales`` + ``g_idx``; gpt-oss's
``gate_up_proj_blocks`` + ``_scales``). The method is read off which suffixes are present and their
dtypes, the way each source convention defines them (see ``hetmoe.formats``); GGUF tensors carry
their ggml type. Tensors that belong to no weight (norms, biases, ``g_idx`` alone) are reported on
their own with method ``""``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .safetensors_file import DTYPE_NAMES, TensorInfo
from .source import TensorSource

# Longest first, so ".weight_scale_inv" is not taken for ".weight_scale" or ".weight".
SUFFIXES = (
    ".weight_zero_point",
    ".weight_scale_inv",
    ".weight_packed",
    ".weight_shape",
    ".weight_scale",
    ".qweight",
    ".qzeros",
    ".scales",
    ".g_idx",
    ".weight",
    "_blocks",
    "_scales",
)
FULL_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


@dataclass
class WeightEntry:
    """One logical weight: its module prefix, stored tensors, method and logical shape."""

    prefix: str
    method: str
    shape: tuple[int, ...]
    tensors: dict[str, TensorInfo]  # suffix -> info
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def full_precision(self) -> bool:
        return self.method in FULL_PRECISION.values()


def dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else DTYPE_NAMES.get(dtype, str(dtype))


def split_key(key: str) -> tuple[str, str]:
    """``"a.b.weight_scale_inv"`` -> ``("a.b", ".weight_scale_inv")``; unknown suffix -> ``(key, "")``."""
    for suffix in SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], suffix
    return key, ""


def group_weights(source: TensorSource) -> list[WeightEntry]:
    """Every weight of ``source`` with its detected method, in checkpoint order."""
    groups: dict[str, dict[str, TensorInfo]] = {}
    loose: list[TensorInfo] = []
    for key in source.keys():
        info = source.info(key)
        if isinstance(info.dtype, str):  # GGUF: one tensor is one weight, typed by ggml
            loose.append(info)
            continue
        prefix, suffix = split_key(key)
        if suffix:
            groups.setdefault(prefix, {})[suffix] = info
        else:
            loose.append(info)
    entries: list[WeightEntry] = []
    for prefix, tensors in groups.items():
        entries.extend(_classify(prefix, tensors))
    for info in loose:
        if isinstance(info.dtype, str):
            entries.append(WeightEntry(info.name, f"gguf:{info.dtype.lower()}", info.shape, {"": info}))
        else:
            entries.append(WeightEntry(info.name, "", info.shape, {"": info}))
    order = {k: i for i, k in enumerate(source.keys())}
    entries.sort(key=lambda e: min(order[t.name] for t in e.tensors.values()))
    return entries


def _classify(prefix: str, t: dict[str, TensorInfo]) -> list[WeightEntry]:
    """Match a prefix's tensors against each convention; leftovers become loose entries."""

    def take(method: str, suffixes: list[str], shape: tuple[int, ...], **params: Any) -> list[WeightEntry]:
        used = {s: t[s] for s in suffixes if s in t}
        rest = [WeightEntry(prefix + s, "", i.shape, {s: i}) for s, i in t.items() if s not in used]
        return [WeightEntry(prefix, method, shape, used, params), *rest]

    if ".qweight" in t and ".scales" in t:
        qw, sc = t[".qweight"].shape, t[".scales"].shape
        k = qw[-2] * 8
        group = k // sc[-2] if sc[-2] else 0
        return take("gptq", [".qweight", ".qzeros", ".scales", ".g_idx"], (*qw[:-2], qw[-1], k), group_size=group)
    if ".weight_packed" in t and ".weight_scale" in t:
        packed, sc = t[".weight_packed"].shape, t[".weight_scale"].shape
        k = packed[-1] * 8
        method = "int4-asym" if ".weight_zero_point" in t else "int4"
        names = [".weight_packed", ".weight_scale", ".weight_shape", ".weight_zero_point"]
        return take(method, names, (*packed[:-1], k), group_size=k // sc[-1], layout="compressed-tensors")
    if "_blocks" in t and "_scales" in t:
        b = t["_blocks"].shape
        return take("mxfp4", ["_blocks", "_scales"], (*b[:-2], b[-2] * b[-1] * 2))
    if ".weight" in t:
        w = t[".weight"]
        if w.dtype == torch.float8_e4m3fn and ".weight_scale_inv" in t:
            s = t[".weight_scale_inv"].shape
            block = [-(-w.shape[-2] // s[-2]), -(-w.shape[-1] // s[-1])] if len(s) >= 2 and s[-1] and s[-2] else []
            return take("fp8", [".weight", ".weight_scale_inv"], w.shape, block_size=block)
        if w.dtype == torch.float8_e4m3fn and ".weight_scale" in t:
            return take("fp8-channel", [".weight", ".weight_scale"], w.shape)
        if w.dtype == torch.int8 and ".weight_scale" in t:
            return take("int8", [".weight", ".weight_scale"], w.shape)
        if w.dtype == torch.uint8 and ".weight_scale" in t:
            sc = t[".weight_scale"].shape
            k = w.shape[-1] * 2
            method = "int4-asym" if ".weight_zero_point" in t else "int4"
            names = [".weight", ".weight_scale", ".weight_zero_point"]
            return take(method, names, (*w.shape[:-1], k), group_size=k // sc[-1] if sc[-1] else 0, layout="bytes")
        if w.dtype in FULL_PRECISION:
            return take(FULL_PRECISION[w.dtype], [".weight"], w.shape)
    return [WeightEntry(prefix + s, "", i.shape, {s: i}) for s, i in t.items()]


def classify(prefix: str, tensors: dict[str, TensorInfo]) -> WeightEntry:
    """The weight a module ``prefix`` stores, given its tensors by suffix; method ``""`` if none matches.

    Readers that already know which tensors make up one weight (e.g. the expert reader, which maps
    fused names such as ``gate_up_proj_scale_inv`` onto codec suffixes) use this instead of
    scanning a whole source with :func:`group_weights`.
    """
    entries = _classify(prefix, tensors) if tensors else []
    if entries and entries[0].prefix == prefix:
        return entries[0]
    first = next(iter(tensors.values()), None)
    shape = first.shape if first is not None else ()
    return WeightEntry(prefix, "", shape, dict(tensors))
