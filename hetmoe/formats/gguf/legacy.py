"""The original 32-element ggml types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Block layouts (little-endian, fp16 ``d``/``m``):

* Q4_0 ``d | qs[16]``: ``w = d * (q - 8)``
* Q4_1 ``d | m | qs[16]``: ``w = d * q + m``
* Q5_0 ``d | qh[4] | qs[16]``: ``w = d * (q - 16)``, bit 4 of element ``j`` is bit ``j`` of ``qh``
* Q5_1 ``d | m | qh[4] | qs[16]``: ``w = d * q + m``
* Q8_0 ``d | qs[32] (int8)``: ``w = q * d``

4-bit codes pack element ``j`` in the low nibble and ``j + 16`` in the high nibble of byte ``j``.
Decoders write into a caller-provided float32 ``out [nblocks, 32]`` (in-place ops, so a large
decode allocates no full-size temporaries) and evaluate ggml's float32 expression in ggml's order,
so results are bit-identical to ``ggml``/``gguf.quants``; encoders follow the reference round-to-nearest quantizers
(``quantize_row_q*_ref``), including their float32 intermediate steps, so they reproduce its bytes.
"""

from __future__ import annotations

import torch

from ._fields import bits_of_bytes, f16_at, f16_to_bytes, nibbles, pack_nibbles, round_half_away, safe_inverse


def _codes4(qs: torch.Tensor) -> torch.Tensor:
    return nibbles(qs).reshape(qs.shape[0], 32)


def _codes5(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    high = bits_of_bytes(qh).reshape(qs.shape[0], 32)  # element j -> bit j%8 of byte j//8
    return _codes4(qs) | (high << 4)


def decode_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_codes4(b[:, 2:18])).sub_(8.0).mul_(f16_at(b, 0))


def decode_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_codes4(b[:, 4:20])).mul_(f16_at(b, 0)).add_(f16_at(b, 2))


def decode_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_codes5(b[:, 2:6], b[:, 6:22])).sub_(16.0).mul_(f16_at(b, 0))


def decode_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_codes5(b[:, 4:8], b[:, 8:24])).mul_(f16_at(b, 0)).add_(f16_at(b, 2))


def decode_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b[:, 2:34].view(torch.int8)).mul_(f16_at(b, 0))


# ---- encoders: x is float32 [nblocks, 32] -------------------------------------------------------


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude, sign kept (first one on ties, as the reference loop)."""
    return x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))


def _pack5(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """5-bit codes ``[nb, 32]`` -> (qh ``[nb, 4]``, qs ``[nb, 16]``)."""
    n = q.shape[0]
    qs = pack_nibbles(q.view(n, 2, 16))
    high = (q >> 4).to(torch.int32).view(n, 4, 8) << torch.arange(8, device=q.device, dtype=torch.int32)
    return high.sum(dim=-1).to(torch.uint8), qs


def encode_q4_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(x) / -8.0  # the extreme maps to -8, the one code with no positive twin
    q = torch.trunc(x * safe_inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat((f16_to_bytes(d), pack_nibbles(q.view(-1, 2, 16))), dim=-1)


def encode_q4_1(x: torch.Tensor) -> torch.Tensor:
    lo = x.amin(dim=-1, keepdim=True)
    d = (x.amax(dim=-1, keepdim=True) - lo) / 15.0
    q = torch.trunc((x - lo) * safe_inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat((f16_to_bytes(d), f16_to_bytes(lo), pack_nibbles(q.view(-1, 2, 16))), dim=-1)


def encode_q5_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(x) / -16.0
    q = torch.trunc(x * safe_inverse(d) + 16.5).clamp(0, 31).to(torch.uint8)
    qh, qs = _pack5(q)
    return torch.cat((f16_to_bytes(d), qh, qs), dim=-1)


def encode_q5_1(x: torch.Tensor) -> torch.Tensor:
    lo = x.amin(dim=-1, keepdim=True)
    d = (x.amax(dim=-1, keepdim=True) - lo) / 31.0
    q = torch.trunc((x - lo) * safe_inverse(d) + 0.5).clamp(0, 31).to(torch.uint8)
    qh, qs = _pack5(q)
    return torch.cat((f16_to_bytes(d), f16_to_bytes(lo), qh, qs), dim=-1)


def encode_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=-1, keepdim=True) / 127.0
    q = round_half_away(x * safe_inverse(d)).to(torch.int8)
    return torch.cat((f16_to_bytes(d), q.view(torch.uint8)), dim=-1)
