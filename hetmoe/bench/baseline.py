"""The torch baseline: a plain loop over active experts with torch's own CPU kernels.

bf16 uses ``F.linear`` in bf16; int8 uses ``torch._weight_int8pack_mm`` (int8 weights, bf16
per-row scales); int4 uses ``torch._weight_int4pack_mm_for_cpu`` on weights repacked once with
``torch._convert_weight_to_int4pack_for_cpu`` (scale per group, zero 0: w = (q - 8) * s).
Methods torch has no CPU kernel for (fp8, gptq, mxfp4, GGUF, int4-asym) are dequantized to bf16
once and run with ``F.linear``: what a user without hetmoe would do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..formats import QuantizedTensor
from ..formats.packing import unpack_nibbles
from .layers import dequantize_expert


class TorchExperts:
    def __init__(self, gate: QuantizedTensor, up: QuantizedTensor, down: QuantizedTensor) -> None:
        self.method = gate.method
        self.group = int(gate.params.get("group_size", 0))
        if self.method == "int4" and gate.params.get("layout", "bytes") != "bytes":
            raise ValueError("the torch baseline reads int4 in the bytes layout")
        self.projs = [self._prepare(q) for q in (gate, up, down)]

    def _prepare(self, q: QuantizedTensor) -> list[tuple[torch.Tensor, ...]]:
        e = q.shape[0]
        if self.method == "bf16":
            return [(q.tensors[".weight"][i],) for i in range(e)]
        if self.method not in ("int8", "int4"):
            return [(dequantize_expert(q, i).bfloat16(),) for i in range(e)]
        if self.method == "int8":
            w, s = q.tensors[".weight"], q.tensors[".weight_scale"]
            return [(w[i], s[i, :, 0].bfloat16()) for i in range(e)]
        out = []
        for i in range(e):
            codes = unpack_nibbles(q.tensors[".weight"][i]).to(torch.int32)
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
            scale = q.tensors[".weight_scale"][i].T.contiguous()  # [K/g, N]
            scales_and_zeros = torch.stack((scale, torch.zeros_like(scale)), dim=-1).bfloat16().contiguous()
            out.append((packed, scales_and_zeros))
        return out

    def _linear(self, x: torch.Tensor, proj: tuple[torch.Tensor, ...]) -> torch.Tensor:
        if self.method not in ("int8", "int4"):
            return F.linear(x, proj[0])
        if self.method == "int8":
            return torch._weight_int8pack_mm(x, proj[0], proj[1])
        return torch._weight_int4pack_mm_for_cpu(x, proj[0], self.group, proj[1])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        xb = x.bfloat16()
        y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
        gate, up, down = self.projs
        for e in ids.unique().tolist():
            if e < 0:
                continue
            tokens, slots = (ids == e).nonzero(as_tuple=True)
            xe = xb[tokens]
            h = F.silu(self._linear(xe, gate[e])) * self._linear(xe, up[e])
            out = self._linear(h, down[e]).float()
            y.index_add_(0, tokens, out * weights[tokens, slots].unsqueeze(1))
        return y.to(x.dtype)
