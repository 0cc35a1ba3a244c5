"""fp8: E4M3 weights with a 128x128 block scale, the DeepSeek-V3/R1 convention.

On disk: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale_inv`` float32
``[ceil(N/128), ceil(K/128)]``. Despite its name the scale is *multiplied*:
``w[n, k] = float(q[n, k]) * weight_scale_inv[n // 128, k // 128]``. Edge blocks are ragged: the
last block row/column covers only what remains of N/K and its scale comes from those elements alone
(as DeepSeek's ``weight_dequant`` masks them), so no padding is stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Codec, FormatError, QuantizedTensor, TensorSpec, check_weight
from .registry import register

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def expand_blocks(scale: torch.Tensor, n: int, k: int, bn: int, bk: int) -> torch.Tensor:
    """Broadcast a per-block scale ``[..., ceil(n/bn), ceil(k/bk)]`` to ``[..., n, k]``."""
    return scale.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]


@register
class FP8BlockCodec(Codec):
    method = "fp8"
    convention = "DeepSeek-V3/R1, MiniMax-M2, Qwen3-FP8: weight e4m3 [N,K], weight_scale_inv f32 per 128x128 block"

    def __init__(self, block_size: tuple[int, int] | list[int] = (128, 128)) -> None:
        bn, bk = (int(b) for b in block_size)
        if bn <= 0 or bk <= 0:
            raise FormatError("weight_block_size", "two positive integers", str(list(block_size)))
        self.block_size = (bn, bk)

    @property
    def params(self) -> dict[str, object]:
        return {"block_size": list(self.block_size)}

    def tensor_specs(self, shape: tuple[int, ...]) -> list[TensorSpec]:
        *lead, n, k = shape
        bn, bk = self.block_size
        return [
            TensorSpec(".weight", torch.float8_e4m3fn, tuple(shape)),
            TensorSpec(".weight_scale_inv", torch.float32, (*lead, -(-n // bn), -(-k // bk))),
        ]

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        check_weight(weight, name)
        *lead, n, k = weight.shape
        bn, bk = self.block_size
        nb, kb = -(-n // bn), -(-k // bk)
        w = weight.float()
        # Zero padding never raises a block's amax, so ragged blocks get the scale of their own elements.
        padded = F.pad(w, (0, kb * bk - k, 0, nb * bn - n))
        blocks = padded.reshape(*lead, nb, bn, kb, bk)
        amax = blocks.abs().amax(dim=(-3, -1))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        codes = (w / expand_blocks(scale, n, k, bn, bk)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return QuantizedTensor(
            self.method,
            tuple(weight.shape),
            {".weight": codes.contiguous(), ".weight_scale_inv": scale.contiguous()},
            self.params,
        )

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        *_, n, k = q.shape
        scale = expand_blocks(q.tensors[".weight_scale_inv"].float(), n, k, *self.block_size)
        return (q.tensors[".weight"].float() * scale).to(dtype)
