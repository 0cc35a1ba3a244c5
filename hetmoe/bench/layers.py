"""Random expert layers at real shapes, built straight in a method's stored layout.

Quantizing hundreds of random experts through the codecs would take minutes; random codes with
realistic scales exercise the kernels identically (the kernels do not look at the values), so
the benchmark builds the stored tensors directly and dequantizes only the experts it checks.
"""

from __future__ import annotations

import torch

from ..formats import QuantizedTensor, get_codec


def random_projection(method: str, experts: int, n: int, k: int, group: int, seed: int) -> QuantizedTensor:
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
    raise ValueError(f"no random layer builder for method {method!r}")


def dequantize_expert(q: QuantizedTensor, expert: int) -> torch.Tensor:
    """One expert of a stacked projection, dequantized to fp32 ``[N, K]``."""
    one = QuantizedTensor(q.method, tuple(q.shape[1:]), {s: t[expert] for s, t in q.tensors.items()}, q.params)
    return get_codec(q.method, **q.params).dequantize(one)
