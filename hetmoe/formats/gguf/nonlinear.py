"""4-bit codebook types: IQ4_NL, IQ4_XS (non-linear int grid) and MXFP4 (e2m1 with e8m0 scale).

All three store 4-bit indices into a fixed 16-entry table, packed like Q4_0 (element ``j`` in the
low nibble, ``j + 16`` in the high nibble of byte ``j`` of a 32-weight group).

* IQ4_NL (18 bytes / 32): ``d | qs[16]``; ``w = d * kvalues[q]``
* IQ4_XS (136 bytes / 256): ``d | scales_h (uint16) | scales_l[4] | qs[128]``; eight 32-weight
  sub-blocks with 6-bit signed scales ``ls`` (low nibble in ``scales_l``, top 2 bits in
  ``scales_h``, offset 32); ``w = (d * ls) * kvalues[q]``
* MXFP4 (17 bytes / 32): ``e | qs[16]``; ``e`` is an e8m0 exponent, stored values are doubled
  e2m1 magnitudes so the scale is ``2**(e - 128)`` (ggml's ``ggml_e8m0_to_fp32_half``)

Decoders fill a caller-provided float32 ``out`` in place and are bit-exact with ggml. The MXFP4
encoder reproduces ggml's reference quantizer; the IQ4 encoders are hetmoe's own round-to-nearest
with a small per-group scale search (not llama.cpp's importance-weighted search, so quality is a
little lower, but no importance matrix is needed).
"""

from __future__ import annotations

import functools
import itertools

import torch

from ..int_scales import lane_sum
from ._fields import f16_at, f16_to_bytes, nibbles, pack_nibbles, safe_inverse

# The IQ4 non-linear grid and the doubled e2m1 values (OCP MX spec); tiny format constants.
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@functools.cache
def _table(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


@functools.cache
def _midpoints(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Decision boundaries between consecutive (sorted) codebook entries."""
    return torch.tensor(
        [(a + b) / 2 for a, b in itertools.pairwise(sorted(values))], dtype=torch.float32, device=device
    )


def _lookup4(codes: torch.Tensor, values: tuple[int, ...], out: torch.Tensor) -> torch.Tensor:
    """``out[...] = values[codes]`` (``out`` shaped like ``codes``)."""
    table = _table(values, codes.device)
    return torch.index_select(table, 0, codes.reshape(-1).to(torch.int32), out=out.view(-1)).view(codes.shape)


# ---- decoders ----------------------------------------------------------------------------------


def decode_iq4_nl(b: torch.Tensor, out: torch.Tensor) -> None:
    codes = nibbles(b[:, 2:18]).reshape(b.shape[0], 32)
    _lookup4(codes, KVALUES_IQ4NL, out).mul_(f16_at(b, 0))


def iq4_xs_scales(b: torch.Tensor) -> torch.Tensor:
    """The eight signed 6-bit sub-block scales of IQ4_XS as int32 ``[n, 8]`` (range -32..31)."""
    n = b.shape[0]
    sl = b[:, 4:8]
    low = torch.stack((sl & 0x0F, sl >> 4), dim=-1).reshape(n, 8).to(torch.int32)
    sh = b[:, 2].to(torch.int32) | (b[:, 3].to(torch.int32) << 8)
    high = (sh.unsqueeze(-1) >> (2 * torch.arange(8, device=b.device, dtype=torch.int32))) & 3
    return (low | (high << 4)) - 32


def decode_iq4_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    dl = (f16_at(b, 0) * iq4_xs_scales(b).to(torch.float32)).unsqueeze(-1)
    codes = nibbles(b[:, 8:136].reshape(n, 8, 16)).reshape(n, 8, 32)
    _lookup4(codes, KVALUES_IQ4NL, out).mul_(dl)


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """ggml's ``ggml_e8m0_to_fp32_half``: ``2**(e - 128)`` as float32, built from its bit pattern.

    ``e < 2`` would need a subnormal, written as a mantissa bit; ``e = 255`` (NaN in the MX spec)
    decodes to ``2**127`` as in ggml.
    """
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.contiguous().view(torch.float32)


def decode_mxfp4(b: torch.Tensor, out: torch.Tensor) -> None:
    codes = nibbles(b[:, 1:17]).reshape(b.shape[0], 32)
    _lookup4(codes, KVALUES_MXFP4, out).mul_(e8m0_half(b[:, 0:1]))


# ---- encoders ----------------------------------------------------------------------------------


# Nearest-grid lookup without a search: every IQ4 decision boundary (midpoint of two grid values)
# is a multiple of 0.5, so the nearest code is constant on each interval ((k-1)/2, k/2] and a
# table indexed by ceil(2v) answers it with one gather. Beyond +-128 the nearest code is an end.
_HALF_STEPS = 256


@functools.cache
def _iq4_code_table(device: torch.device) -> torch.Tensor:
    right_ends = torch.arange(-_HALF_STEPS, _HALF_STEPS + 1, dtype=torch.float32) / 2
    # bucketize (right=False) puts a value equal to a boundary in the lower bucket: ties -> lower code
    return torch.bucketize(right_ends, _midpoints(KVALUES_IQ4NL, torch.device("cpu"))).to(torch.int32).to(device)


@functools.cache
def _iq4_value_table(device: torch.device) -> torch.Tensor:
    return _table(KVALUES_IQ4NL, device)[_iq4_code_table(device).to(torch.int64)]


def _half_step_index(v: torch.Tensor) -> torch.Tensor:
    # A scale so small that its inverse overflows gives inf for a weight and NaN (0 * inf) for a zero
    # weight, whose nearest code is zero's; infinities land on the grid ends.
    half_steps = torch.ceil(torch.nan_to_num(v * 2.0, nan=0.0)).clamp_(-_HALF_STEPS, _HALF_STEPS)
    return (half_steps + _HALF_STEPS).to(torch.int32).reshape(-1)


def _nearest_iq4(v: torch.Tensor) -> torch.Tensor:
    """Index of the nearest IQ4_NL grid value to ``v`` (already divided by the scale); ties go low."""
    return torch.index_select(_iq4_code_table(v.device), 0, _half_step_index(v)).view(v.shape)


def _nearest_iq4_value(v: torch.Tensor) -> torch.Tensor:
    """The nearest IQ4_NL grid value itself (what the scale search needs), same tie rule."""
    return torch.index_select(_iq4_value_table(v.device), 0, _half_step_index(v)).view(v.shape)


# Scale candidates, as multiples of "the largest-magnitude weight lands on the grid end". Both
# grid ends are tried because the grid is asymmetric (-127 .. 113).
_IQ4_STRETCH = (0.8, 0.85, 0.9, 0.95, 1.0, 1.05)


def _iq4_group_scales(x: torch.Tensor) -> torch.Tensor:
    """Best float scale per 32-weight group of ``x [..., 32]`` for the IQ4 grid: ``[..., 1]``.

    For every candidate scale, assign nearest codes, refit the scale by least squares
    (``s = <x,k> / <k,k>``) and keep the candidate with the smallest squared error
    (equivalently the largest ``<x,k>^2 / <k,k>``).
    """
    xm = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))
    bases = torch.stack([xm / -127.0, xm / 113.0], dim=0)  # [2, ..., 1]
    stretch = torch.tensor(_IQ4_STRETCH, dtype=x.dtype, device=x.device).view(-1, *([1] * xm.dim()))
    cands = (bases.unsqueeze(1) * stretch).flatten(0, 1)  # [C, ..., 1]
    k = _nearest_iq4_value(x.unsqueeze(0) * safe_inverse(cands))
    sxk = lane_sum(x.unsqueeze(0) * k).unsqueeze(-1)  # in a fixed order the engine's encoder repeats
    skk = (k * k).sum(-1, keepdim=True)  # squared integers: exact in any order
    best = (sxk * sxk / skk).argmax(dim=0, keepdim=True)
    return (sxk / skk).gather(0, best).squeeze(0)


def encode_iq4_nl(x: torch.Tensor) -> torch.Tensor:
    d = _iq4_group_scales(x).to(torch.float16).to(torch.float32)  # codes must see the stored scale
    codes = _nearest_iq4(x * safe_inverse(d))
    return torch.cat((f16_to_bytes(d), pack_nibbles(codes.view(-1, 2, 16))), dim=-1)


def encode_iq4_xs(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    xs = x.view(n, 8, 32)
    s = _iq4_group_scales(xs).squeeze(-1)  # [n, 8] signed group scales
    # Super-scale: the largest-magnitude group scale maps to ls = -32, the end without a twin.
    d = (s.gather(-1, s.abs().argmax(dim=-1, keepdim=True)) / -32.0).to(torch.float16).to(torch.float32)
    ls = torch.round(s * safe_inverse(d)).clamp(-32, 31)
    eff = (d * ls).unsqueeze(-1)
    codes = _nearest_iq4(xs * safe_inverse(eff))
    u = (ls + 32).to(torch.int32)  # 0..63
    lo = (u & 0x0F).to(torch.uint8).view(n, 4, 2)
    scales_l = lo[..., 0] | (lo[..., 1] << 4)
    sh = ((u >> 4) << (2 * torch.arange(8, device=x.device, dtype=torch.int32))).sum(-1)
    scales_h = torch.stack((sh & 0xFF, sh >> 8), dim=-1).to(torch.uint8)
    qs = pack_nibbles(codes.view(n, 8, 2, 16)).reshape(n, 128)
    return torch.cat((f16_to_bytes(d), scales_h, scales_l, qs), dim=-1)


def encode_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """ggml's reference MXFP4 quantizer: shared exponent from the block max, nearest e2m1 value.

    ``e = floor(log2(amax)) - 2 + 127`` puts the block maximum in the top e2m1 binade. Codes are
    the nearest doubled magnitude (ties to the smaller one, as the reference's first-minimum
    search) with the sign in bit 3; zero is always code 0.
    """
    amax = x.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.where(amax > 0, torch.floor(torch.log2(safe)) - 2 + 127, torch.zeros_like(amax))
    e = e.clamp(0, 255).to(torch.int32)
    d = e8m0_half(e)
    mag = torch.bucketize(x.abs() / d, _midpoints(KVALUES_MXFP4[:8], x.device))
    codes = torch.where((x < 0) & (mag > 0), mag + 8, mag)
    return torch.cat((e.to(torch.uint8), pack_nibbles(codes.view(-1, 2, 16))), dim=-1)
