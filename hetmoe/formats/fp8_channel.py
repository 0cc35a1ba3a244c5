"""fp8-channel: E4M3 weights with one scale per output row (GLM-4.7-FP8, compressed-tensors
``float-quantized`` with the channel strategy).

On disk: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale`` ``[N, 1]``;
``w[n, k] = float(q[n, k]) * weight_scale[n]``. hetmoe writes the scale as float32 ``[N, 1]`` and
reads any float dtype and ``[N]`` as well, because checkpoints in the wild carry both.
"""

from __future__ import annotations

import torch

from .base import Codec, FormatError, QuantizedTensor, TensorSpec, check_weight
from .fp8 import FP8_MAX
from .registry import register


@register
class FP8ChannelCodec(Codec):
    method = "fp8-channel"
    convention = "GLM-4.7-FP8: weight e4m3 [N,K], weight_scale per output row [N,1]"

    def tensor_specs(self, shape: tuple[int, ...]) -> list[TensorSpec]:
        return [
            TensorSpec(".weight", torch.float8_e4m3fn, tuple(shape)),
            TensorSpec(".weight_scale", torch.float32, (*shape[:-1], 1)),
        ]

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        check_weight(weight, name)
        w = weight.float()
        amax = w.abs().amax(-1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        codes = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedTensor(self.method, tuple(weight.shape), {".weight": codes, ".weight_scale": scale})

    def canonical(self, q: QuantizedTensor, name: str = "weight") -> QuantizedTensor:
        """The same tensor with its scale as float32 ``[..., N, 1]``; ``[..., N]`` and bf16/fp16 accepted."""
        scale = q.tensors.get(".weight_scale")
        if scale is None:
            return q
        if not scale.is_floating_point():
            raise FormatError(name + ".weight_scale", "a floating-point scale", f"dtype {scale.dtype}")
        if tuple(scale.shape) == tuple(q.shape[:-1]):
            scale = scale.unsqueeze(-1)
        return QuantizedTensor(q.method, q.shape, {**q.tensors, ".weight_scale": scale.float()}, q.params)

    def validate(self, q: QuantizedTensor, name: str = "weight") -> None:
        super().validate(self.canonical(q, name), name)

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.canonical(q)
        return (q.tensors[".weight"].float() * q.tensors[".weight_scale"]).to(dtype)
