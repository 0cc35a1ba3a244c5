"""Lattice I-quant decoders: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S.

These types store, per group of 8 (IQ1/IQ2) or 4 (IQ3) weights, an index into a fixed codebook
(:mod:`.grids`), plus sign bits and small sub-block scales under one fp16 ``d``. They are
decode-only in hetmoe: producing good I-quants needs llama.cpp's importance-matrix search
(``llama-quantize``). Every product is evaluated in ggml's float32 order (``db * grid * sign``,
``dl * (grid + delta)``), so outputs are bit-identical to ggml / ``gguf.quants``. The codebook
rows are gathered straight into the caller's float32 ``out`` and scaled there in place.

Layouts (byte offsets within the 256-weight block):

* IQ2_XXS (66): d | 8 x (4 grid bytes, uint32 aux); aux = 4 x 7-bit sign index | 4-bit scale
* IQ2_XS (74):  d | 32 x uint16 (9-bit grid index | 7-bit sign index) | scales[8] (nibbles)
* IQ2_S (82):   d | qs[32] | signs[32] | qh[8] (2 high index bits each) | scales[8]
* IQ3_XXS (98): d | qs[64] grid bytes | 8 x uint32 aux (as IQ2_XXS, scale step 0.5)
* IQ3_S (110):  d | qs[64] | qh[8] (1 high index bit each) | signs[32] | scales[4] (odd 1..31)
* IQ1_S (50):   d | qs[32] | 8 x uint16 (4 x 3 high index bits | 3-bit scale | delta sign)
* IQ1_M (56):   qs[32] | qh[16] (3 high bits + delta sign per nibble) | 4 x uint16 scales whose
  top nibbles together form the fp16 ``d``
"""

from __future__ import annotations

import torch

from ._fields import bits_of_bytes, f16_at, shifts, u16_at
from .grids import bit_sign_table, grid, sign_table

_IQ1_DELTA = 0.125


def _lookup(table: torch.Tensor, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``table[idx]`` as ``[*idx.shape, width]``, written into ``out`` when given (any shape, same numel)."""
    width = table.shape[1]
    dest = None if out is None else out.view(-1, width)
    rows = torch.index_select(table, 0, idx.reshape(-1).to(torch.int32), out=dest)
    return rows.view(*idx.shape, width)


def _aux32(b: torch.Tensor, offset: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` uint32 aux words at ``offset`` -> (4 sign indices ``[n, count, 4]``, scale ``[n, count]``).

    Bits 0-27 are four 7-bit ``ksigns`` indices, bits 28-31 the sub-block scale. The low 28 bits
    are assembled in int32 (the top nibble is read separately, so nothing overflows).
    """
    w = b[:, offset : offset + 4 * count].reshape(-1, count, 4).to(torch.int32)
    low28 = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | ((w[..., 3] & 0x0F) << 24)
    sidx = (low28.unsqueeze(-1) >> shifts(b.device, 0, 7, 14, 21, dtype=torch.int32)) & 0x7F
    return sidx, (w[..., 3] >> 4).to(torch.float32)


def _nibble_scales(s: torch.Tensor) -> torch.Tensor:
    """``uint8 [n, m]`` -> float ``[n, 2m]``, scale ``2j`` in the low and ``2j+1`` in the high nibble."""
    return torch.stack((s & 0x0F, s >> 4), dim=-1).reshape(s.shape[0], -1).to(torch.float32)


def decode_iq2_xxs(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sidx, sc = _aux32(_iq2xxs_aux(b), 0, 8)
    db = (f16_at(b, 0) * (0.5 + sc) * 0.25).view(n, 8, 1, 1)
    gidx = b[:, 2:66].reshape(n, 8, 8)[..., 0:4]
    vals = _lookup(grid("iq2xxs", b.device), gidx, out)  # [n, 8, 4, 8]
    vals.mul_(db).mul_(_lookup(sign_table(b.device), sidx))


def _iq2xxs_aux(b: torch.Tensor) -> torch.Tensor:
    """The eight aux words of IQ2_XXS (bytes 4-7 of every 8-byte group), made contiguous."""
    return b[:, 2:66].reshape(-1, 8, 8)[..., 4:8].reshape(-1, 32)


def decode_iq2_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    q = u16_at(b, 2, 32)
    db = (f16_at(b, 0) * (0.5 + _nibble_scales(b[:, 66:74])) * 0.25).view(n, 16, 1, 1)
    vals = _lookup(grid("iq2xs", b.device), q & 511, out).view(n, 16, 2, 8)
    vals.mul_(db).mul_(_lookup(sign_table(b.device), q >> 9).view(n, 16, 2, 8))


def decode_iq2_s(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    qh = (b[:, 66:74].unsqueeze(-1) >> shifts(b.device, 0, 2, 4, 6)) & 0x03  # entry i: bits 2(i%4) of qh[i//4]
    gidx = b[:, 2:34].to(torch.int32) | (qh.reshape(n, 32).to(torch.int32) << 8)
    db = (f16_at(b, 0) * (0.5 + _nibble_scales(b[:, 74:82])) * 0.25).view(n, 16, 1, 1)
    vals = _lookup(grid("iq2s", b.device), gidx, out).view(n, 16, 2, 8)
    vals.mul_(db).mul_(_lookup(bit_sign_table(b.device), b[:, 34:66]).view(n, 16, 2, 8))


def decode_iq3_xxs(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sidx, sc = _aux32(b, 66, 8)
    db = (f16_at(b, 0) * (0.5 + sc) * 0.5).view(n, 8, 1, 1)
    vals = _lookup(grid("iq3xxs", b.device), b[:, 2:66], out).view(n, 8, 4, 8)
    vals.mul_(db).mul_(_lookup(sign_table(b.device), sidx))


def decode_iq3_s(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    high = bits_of_bytes(b[:, 66:74]).reshape(n, 64).to(torch.int32)  # entry i: bit i%8 of qh[i//8]
    gidx = b[:, 2:66].to(torch.int32) | (high << 8)
    s = b[:, 106:110]
    odd = 1 + 2 * torch.stack((s & 0x0F, s >> 4), dim=-1).reshape(n, 8).to(torch.int32)
    db = (f16_at(b, 0) * odd.to(torch.float32)).view(n, 8, 1, 1)
    vals = _lookup(grid("iq3s", b.device), gidx, out).view(n, 8, 4, 8)
    vals.mul_(db).mul_(_lookup(bit_sign_table(b.device), b[:, 74:106]).view(n, 8, 4, 8))


def decode_iq1_s(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    qh = u16_at(b, 34, 8)  # [n, 8]
    dl = (f16_at(b, 0) * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).view(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) != 0, -_IQ1_DELTA, _IQ1_DELTA).view(n, 8, 1, 1)
    high = (qh.unsqueeze(-1) >> shifts(b.device, 0, 3, 6, 9, dtype=torch.int32)) & 7  # [n, 8, 4]
    gidx = b[:, 2:34].to(torch.int32) | (high.reshape(n, 32) << 8)
    vals = _lookup(grid("iq1s", b.device), gidx, out).view(n, 8, 4, 8)
    vals.add_(delta).mul_(dl)  # dl * (grid + delta): the sum is exact, one rounding in the product


def iq1_m_scale_bytes(b: torch.Tensor) -> torch.Tensor:
    """IQ1_M's fp16 ``d``, gathered from the top nibbles of its four uint16 scale words, as ``uint8 [n, 2]``."""
    s = b[:, 48:56]
    lo = (s[:, 1] >> 4) | (s[:, 3] & 0xF0)
    hi = (s[:, 5] >> 4) | (s[:, 7] & 0xF0)
    return torch.stack((lo, hi), dim=-1)


def decode_iq1_m(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d = iq1_m_scale_bytes(b).view(torch.float16).to(torch.float32)  # [n, 1]
    words = u16_at(b, 48, 4)
    sc = ((words.unsqueeze(-1) >> shifts(b.device, 0, 3, 6, 9, dtype=torch.int32)) & 7).reshape(n, 16)
    dl = (d * (2 * sc + 1).to(torch.float32)).view(n, 8, 2, 1, 1)
    qh = b[:, 32:48]
    nib = torch.stack((qh & 0x0F, qh >> 4), dim=-1).reshape(n, 32)  # entry i: nibble i%2 of qh[i//2]
    gidx = b[:, 0:32].to(torch.int32) | ((nib & 7).to(torch.int32) << 8)
    delta = torch.where((nib & 8) != 0, -_IQ1_DELTA, _IQ1_DELTA).view(n, 8, 2, 2, 1)
    vals = _lookup(grid("iq1s", b.device), gidx, out).view(n, 8, 2, 2, 8)
    vals.add_(delta).mul_(dl)
