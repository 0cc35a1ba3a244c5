"""mxfp4: OCP MX FP4 (E2M1 elements, one e8m0 exponent per 32), as gpt-oss stores its experts.

On disk (gpt-oss names a weight ``W`` as ``W_blocks`` / ``W_scales``): ``blocks`` uint8
``[N, K/32, 16]`` holding two E2M1 codes a byte, low nibble first (element 2j low, 2j+1 high);
``scales`` uint8 ``[N, K/32]``, the block's power of two with bias 127: ``w = e2m1(code) * 2**(s-127)``.
E2M1 codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives. The exponent 255
is e8m0's NaN and is rejected.
"""

from __future__ import annotations

import torch

from .base import Codec, FormatError, QuantizedTensor, TensorSpec, check_divisible, check_weight
from .int_scales import squared_error
from .packing import pack_nibbles, unpack_nibbles
from .registry import register

BLOCK = 32
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
# Midpoints between consecutive non-negative E2M1 magnitudes: rounding by bucketing keeps the
# quantizer vectorised; a value exactly halfway rounds to the smaller magnitude.
_MAGNITUDES = E2M1_VALUES[:8]
_MIDPOINTS = (_MAGNITUDES[1:] + _MAGNITUDES[:-1]) / 2


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (0..15) for each value of ``x`` already divided by its block scale."""
    mag = torch.bucketize(x.abs().clamp(max=6.0), _MIDPOINTS, right=False)
    return (mag + 8 * (x < 0).to(mag.dtype)).to(torch.uint8)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` for finite ``x > 0``, exactly (a library log2 may land a hair off an integer):
    ``x = f * 2^e`` with ``f`` in [0.5, 1), so it is ``e - 1`` where ``f == 0.5`` and ``e`` elsewhere."""
    f, e = torch.frexp(x)
    return torch.where(f == 0.5, e - 1, e).to(torch.int32)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2^e`` as float32 for integer ``e`` in [-127, 127], built exactly (2^-127 is subnormal)."""
    e = e.to(torch.int32)
    normal = ((e.clamp(min=-126) + 127) << 23).view(torch.float32)
    return torch.where(e >= -126, normal, torch.full_like(normal, 2.0**-127))


@register
class MXFP4Codec(Codec):
    method = "mxfp4"
    convention = "gpt-oss / OCP MX: E2M1 pairs, low nibble first [N,K/32,16] + e8m0 exponent per 32 [N,K/32]"

    def tensor_specs(self, shape: tuple[int, ...]) -> list[TensorSpec]:
        *lead, n, k = shape
        return [
            TensorSpec("_blocks", torch.uint8, (*lead, n, k // BLOCK, BLOCK // 2)),
            TensorSpec("_scales", torch.uint8, (*lead, n, k // BLOCK)),
        ]

    def quantize(self, weight: torch.Tensor, name: str = "weight") -> QuantizedTensor:
        check_weight(weight, name)
        *lead, n, k = weight.shape
        check_divisible(k, BLOCK, name, "K")
        w = weight.float().reshape(*lead, n, k // BLOCK, BLOCK)
        amax = w.abs().amax(-1, keepdim=True)
        # The smallest power of two that maps amax into E2M1's range [0, 6], and one below it
        # (which clips the block maximum but halves the step): keep whichever errs less.
        e_hi = ceil_log2(torch.where(amax > 0, amax / 6.0, torch.ones_like(amax))).clamp(-127, 127)
        best_codes, best_e, best_err = None, None, None
        for e in (e_hi, (e_hi - 1).clamp(min=-127)):
            scale = pow2(e)
            codes = e2m1_codes(w / scale)
            err = squared_error(w, E2M1_VALUES[codes.long()] * scale)
            if best_codes is None:
                best_codes, best_e, best_err = codes, e, err
            else:
                better = err < best_err
                best_codes = torch.where(better, codes, best_codes)
                best_e = torch.where(better, e, best_e)
                best_err = torch.where(better, err, best_err)
        assert best_codes is not None and best_e is not None
        blocks = pack_nibbles(best_codes)
        scales = (best_e.squeeze(-1) + 127).to(torch.uint8)
        return QuantizedTensor(self.method, tuple(weight.shape), {"_blocks": blocks, "_scales": scales})

    def validate(self, q: QuantizedTensor, name: str = "weight") -> None:
        check_divisible(q.shape[-1], BLOCK, name, "K")
        super().validate(q, name)
        nan = int((q.tensors["_scales"] == 255).sum())
        if nan:
            raise FormatError(name + "_scales", "e8m0 exponents below 255", f"{nan} NaN exponents (255)")

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        *lead, n, k = q.shape
        codes = unpack_nibbles(q.tensors["_blocks"])  # [..., N, K/32, 32]
        values = E2M1_VALUES.to(codes.device)[codes.long()]  # the table follows the codes onto a GPU
        exponent = q.tensors["_scales"].to(torch.int32) - 127
        return torch.ldexp(values, exponent.unsqueeze(-1).float()).reshape(*lead, n, k).to(dtype)
