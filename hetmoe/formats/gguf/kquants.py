"""K-quant decoders: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (256-weight super-blocks).

Each super-block has an fp16 ``d`` (and ``dmin`` for the affine types) and small integer
sub-block scales; a weight is ``(d * sub_scale) * q`` (minus ``dmin * sub_min``), evaluated in
that order in float32 exactly as ggml's ``dequantize_row_q*_K`` so the result is bit-identical.
Decoders fill a caller-provided float32 ``out [nblocks, 256]`` with in-place ops.

Layouts (byte offsets within the block):

* Q2_K (84):  scales[16] (lo nibble scale, hi nibble min) | qs[64] 2-bit | d | dmin; 16 sub-blocks of 16
* Q3_K (110): hmask[32] | qs[64] 2-bit | scales[12] (6-bit, packed) | d; value ``q - 4*(1 - hbit)``
* Q4_K (144): d | dmin | scales[12] (6-bit scale+min pairs) | qs[128]; 8 sub-blocks of 32
* Q5_K (176): d | dmin | scales[12] | qh[32] | qs[128]
* Q6_K (210): ql[128] | qh[64] | scales[16] (int8) | d; 16 sub-blocks of 16, value ``q - 32``

Within each 128-weight half of Q2_K/Q3_K/Q6_K, 2-bit fields of one byte are 32 weights apart;
the ``crumbs``/``nibbles`` helpers produce exactly that order.
"""

from __future__ import annotations

import torch

from ._fields import bits_planes, crumbs, f16_at, nibbles


def scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K/Q5_K's 12 scale bytes into eight 6-bit scales and eight 6-bit mins.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; scales/mins 4-7 keep their low
    nibble in bytes 8-11 and their top two bits in the spare top bits of bytes 0-3 / 4-7.
    """
    lo_s, lo_m, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo_s & 0x3F, (mixed & 0x0F) | ((lo_s >> 2) & 0x30)), dim=-1)
    mn = torch.cat((lo_m & 0x3F, (mixed >> 4) | ((lo_m >> 2) & 0x30)), dim=-1)
    return sc, mn


def decode_q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sc = b[:, 0:16]
    dl = (f16_at(b, 80) * (sc & 0x0F).to(torch.float32)).unsqueeze(-1)
    ml = (f16_at(b, 82) * (sc >> 4).to(torch.float32)).unsqueeze(-1)
    o = out.view(n, 16, 16)
    o.copy_(crumbs(b[:, 16:80].reshape(n, 2, 32)).reshape(n, 16, 16)).mul_(dl).sub_(ml)


def decode_q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    s = b[:, 96:108]
    low = nibbles(s[:, 0:8]).reshape(n, 16)  # scale i<8: low nibble of byte i; i>=8: high nibble of byte i-8
    high = crumbs(s[:, 8:12]).reshape(n, 16)  # scale i: bits 2*(i//4) of byte 8 + i%4
    scales = (low | (high << 4)).to(torch.float32) - 32.0
    dl = (f16_at(b, 108) * scales).unsqueeze(-1)
    ql = crumbs(b[:, 32:96].reshape(n, 2, 32)).reshape(n, 16, 16)
    hbit = bits_planes(b[:, 0:32]).reshape(n, 16, 16)  # weight e: bit e//32 of hmask[e%32]
    # A clear high bit means "subtract 4": ggml stores the complement of the 3rd bit.
    q = ql.to(torch.int8) - ((hbit ^ 1) << 2).to(torch.int8)
    out.view(n, 16, 16).copy_(q).mul_(dl)


def decode_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sc, mn = scale_min_k4(b[:, 4:16])
    dl = (f16_at(b, 0) * sc.to(torch.float32)).unsqueeze(-1)
    ml = (f16_at(b, 2) * mn.to(torch.float32)).unsqueeze(-1)
    o = out.view(n, 8, 32)
    o.copy_(nibbles(b[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)).mul_(dl).sub_(ml)


def decode_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sc, mn = scale_min_k4(b[:, 4:16])
    dl = (f16_at(b, 0) * sc.to(torch.float32)).unsqueeze(-1)
    ml = (f16_at(b, 2) * mn.to(torch.float32)).unsqueeze(-1)
    ql = nibbles(b[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = bits_planes(b[:, 16:48])  # sub-block s takes bit s of qh[j]
    out.view(n, 8, 32).copy_(ql | (qh << 4)).mul_(dl).sub_(ml)


def decode_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    ql = nibbles(b[:, 0:128].reshape(n, 2, 64)).reshape(n, 16, 16)
    qh = crumbs(b[:, 128:192].reshape(n, 2, 32)).reshape(n, 16, 16)
    dl = (f16_at(b, 208) * b[:, 192:208].view(torch.int8).to(torch.float32)).unsqueeze(-1)
    out.view(n, 16, 16).copy_(ql | (qh << 4)).sub_(32.0).mul_(dl)
