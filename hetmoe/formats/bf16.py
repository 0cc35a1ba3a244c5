"""bf16: the plain checkpoint convention, one ``weight`` tensor ``[N, K]`` in bfloat16."""

from __future__ import annotations

import torch

from .base import Codec, QuantizedTensor, TensorSpec, check_weight
from .registry import register


@register
class BF16Codec(Codec):
    method = "bf16"
    convention = "plain checkpoints: weight bf16 [N, K]"

    def tensor_specs(self, shape: tuple[int, ...]) -> list[TensorSpec]:
        return [TensorSpec(".weight", torch.bfloat16, tuple(shape))]

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        check_weight(weight, name)
        return QuantizedTensor(self.method, tuple(weight.shape), {".weight": weight.to(torch.bfloat16).contiguous()})

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return q.tensors[".weight"].to(dtype)
