"""Random projections of stacked experts at real shapes, built straight in a method's stored layout.

Quantizing hundreds of random experts through the codecs would take minutes; random codes with
realistic scales exercise the kernels identically (the kernels do not look at the values), so the
benchmarks and the engine's tuner (runtime/tuning.py) build the stored tensors directly.
"""

from __future__ import annotations

import torch

from .base import QuantizedTensor


def random_projection(method: str, experts: int, n: int, k: int, group: int, seed: int) -> QuantizedTensor:
    """Stacked experts ``[experts, n, k]`` of ``method`` with random codes and scales, on huge pages
    as a model file's weights are mapped (hw/huge_pages.py), so timings see the pages a model has."""
    return _random_projection(method, experts, n, k, group, seed).on_huge_pages()


def _random_projection(method: str, experts: int, n: int, k: int, group: int, seed: int) -> QuantizedTensor:
    g = torch.Generator().manual_seed(seed)
    shape = (experts, n, k)
    if method == "bf16":
        return QuantizedTensor("bf16", shape, {".weight": (torch.randn(shape, generator=g) * 0.02).bfloat16()})
    if method == "int8":
        codes = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        scale = torch.rand(experts, n, 1, generator=g) * 2e-4 + 1e-4
        return QuantizedTensor("int8", shape, {".weight": codes, ".weight_scale": scale})
    if method == "int4":
        codes = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8)
        scale = (torch.rand(experts, n, k // group, generator=g) * 4e-3 + 1e-3).bfloat16()
        return QuantizedTensor(
            "int4", shape, {".weight": codes, ".weight_scale": scale}, {"group_size": group, "layout": "bytes"}
        )
    if method == "int4-asym":
        codes = torch.randint(0, 256, (experts, n, k // 2), generator=g, dtype=torch.uint8)
        scale = (torch.rand(experts, n, k // group, generator=g) * 4e-3 + 1e-3).bfloat16()
        zero = torch.randint(4, 12, (experts, n, k // group), generator=g, dtype=torch.uint8)
        tensors = {".weight": codes, ".weight_scale": scale, ".weight_zero_point": zero}
        return QuantizedTensor("int4-asym", shape, tensors, {"group_size": group, "layout": "bytes"})
    if method == "gptq":
        qweight = torch.randint(-(2**31), 2**31 - 1, (experts, k // 8, n), generator=g, dtype=torch.int32)
        scales = (torch.rand(experts, k // group, n, generator=g) * 4e-3 + 1e-3).half()
        qzeros = torch.full((experts, k // group, n // 8), 0x77777777, dtype=torch.int32)
        g_idx = (torch.arange(k, dtype=torch.int32) // group).expand(experts, k).contiguous()
        tensors = {".qweight": qweight, ".qzeros": qzeros, ".scales": scales, ".g_idx": g_idx}
        return QuantizedTensor("gptq", shape, tensors, {"group_size": group, "sym": True, "checkpoint_format": "gptq"})
    if method == "mxfp4":
        blocks = torch.randint(0, 256, (experts, n, k // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 124, (experts, n, k // 32), generator=g, dtype=torch.uint8)
        return QuantizedTensor("mxfp4", shape, {"_blocks": blocks, "_scales": scales})
    if method in ("fp8", "fp8-channel"):
        codes = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        codes = torch.where((codes & 0x7F) == 0x7F, codes ^ 1, codes).view(torch.float8_e4m3fn)  # no NaN bytes
        if method == "fp8":
            scale = torch.rand(experts, -(-n // 128), -(-k // 128), generator=g) * 1e-4 + 1e-5
            return QuantizedTensor(
                "fp8", shape, {".weight": codes, ".weight_scale_inv": scale}, {"block_size": [128, 128]}
            )
        scale = torch.rand(experts, n, 1, generator=g) * 1e-4 + 1e-5
        return QuantizedTensor("fp8-channel", shape, {".weight": codes, ".weight_scale": scale})
    if method.startswith("gguf:"):
        from .gguf import GGML_TYPES

        info = GGML_TYPES.get(method.split(":", 1)[1].upper())
        if info is None or info.is_float or not info.f16_scale_offsets:
            raise ValueError(f"bench builds random GGUF layers for block types with fp16 scales, not {method!r}")
        nb = k // info.block_elements
        # Random codes are valid in every block type; the fp16 super-scales get realistic values.
        raw = torch.randint(0, 256, (experts, n, nb, info.block_bytes), generator=g, dtype=torch.uint8)
        for offset in info.f16_scale_offsets:
            d = (torch.rand(experts, n, nb, generator=g) * 2e-4 + 1e-4).half().view(torch.uint8)
            raw[..., offset : offset + 2] = d.reshape(experts, n, nb, 2)
        return QuantizedTensor(
            method, shape, {".weight": raw.reshape(experts, n, nb * info.block_bytes)}, {"ggml_type": info.name}
        )
    raise ValueError(f"no random layer builder for method {method!r}")
