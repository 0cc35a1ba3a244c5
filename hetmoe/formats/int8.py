"""int8: symmetric per-output-row int8, hetmoe's own 8-bit expert store format.

On disk: ``weight`` int8 ``[N, K]`` (codes -127..127) and ``weight_scale`` float32 ``[N, 1]`` =
row amax / 127; ``w = q * s``.
"""

from __future__ import annotations

import torch

from .base import Codec, QuantizedTensor, TensorSpec, check_weight
from .int_scales import symmetric_int8_rows
from .registry import register


@register
class Int8Codec(Codec):
    method = "int8"
    convention = "symmetric per row: weight int8 [N,K], weight_scale f32 [N,1] = amax/127"

    def tensor_specs(self, shape: tuple[int, ...]) -> list[TensorSpec]:
        return [
            TensorSpec(".weight", torch.int8, tuple(shape)),
            TensorSpec(".weight_scale", torch.float32, (*shape[:-1], 1)),
        ]

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        check_weight(weight, name)
        q, s = symmetric_int8_rows(weight)
        return QuantizedTensor(self.method, tuple(weight.shape), {".weight": q, ".weight_scale": s})

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (q.tensors[".weight"].float() * q.tensors[".weight_scale"].float()).to(dtype)
