"""Round-to-nearest encoders for Q4_K, Q5_K and Q6_K.

hetmoe's own simple quantizers, not llama.cpp's iterative ``make_qkx``/``make_qx`` searches:
each sub-block gets a float scale (and for Q4_K/Q5_K a non-negative min) from its range, the
super-block fp16 ``d``/``dmin`` is set so the largest sub-scale uses the full 6-bit (or int8)
range, the sub-scales are rounded to integers, and finally the weights are rounded against the
*stored* (rounded) scales, so decode sees exactly the grid the codes were chosen on. A least
squares refit of each sub-block's scale/min after a first rounding pass recovers most of what
the range-based choice loses. Layouts are documented in :mod:`.kquants`.
"""

from __future__ import annotations

import torch

from ..int_scales import lane_sum, squared_error
from ._fields import f16_to_bytes, pack_bits_planes, pack_nibbles, safe_inverse


def _to_f16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _affine_fit(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sub-block ``(scale, min)`` with ``x ~ scale * q - min``, ``q`` in ``0..nmax``, ``min >= 0``.

    Start from the range (min clamped to <= 0 so the stored min is non-negative, as ggml requires),
    round, then refit ``scale, min`` by least squares on those codes; keep the refit only where it
    lowers the error.
    """
    lo = x.amin(dim=-1, keepdim=True).clamp(max=0.0)
    scale = (x.amax(dim=-1, keepdim=True) - lo) / nmax
    mn = -lo
    q = torch.round((x + mn) * safe_inverse(scale)).clamp(0, nmax)
    # Least squares for x ~ a*q + c over each sub-block (2x2 normal equations).
    n = x.shape[-1]
    sq, sqq = q.sum(-1, keepdim=True), (q * q).sum(-1, keepdim=True)  # small integers: exact in any order
    # Sums of floats in int_scales.lane_sum's fixed order, which the engine's encoders repeat.
    sx, sqx = lane_sum(x).unsqueeze(-1), lane_sum(q * x).unsqueeze(-1)
    det = n * sqq - sq * sq
    ok = det > 0
    a = torch.where(ok, (n * sqx - sq * sx) / torch.where(ok, det, 1.0), scale)
    c = torch.where(ok, (sx - a * sq) / n, -mn)
    # The format needs min >= 0 (c <= 0) and scale >= 0; otherwise fall back to the range fit.
    ok = ok & (c <= 0) & (a >= 0)
    a, c = torch.where(ok, a, scale), torch.where(ok, c, -mn)
    err_old = squared_error(scale * q - mn, x)
    q2 = torch.round((x - c) * safe_inverse(a)).clamp(0, nmax)
    err_new = squared_error(a * q2 + c, x)
    better = err_new < err_old
    return torch.where(better, a, scale).squeeze(-1), torch.where(better, -c, mn).squeeze(-1)


def _six_bit(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative per-sub-block values ``[n, 8]`` -> (fp16 super-scale ``[n, 1]``, 6-bit ints ``[n, 8]``)."""
    d = _to_f16(v.amax(dim=-1, keepdim=True) / 63.0)
    return d, torch.round(v * safe_inverse(d)).clamp(0, 63)


def _pack_scale_min_k4(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`.kquants.scale_min_k4`: eight 6-bit scales and mins -> 12 bytes."""
    sc, mn = sc.to(torch.uint8), mn.to(torch.uint8)
    first = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    second = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    mixed = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return torch.cat((first, second, mixed), dim=-1)


def _encode_affine_k(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared Q4_K/Q5_K part: (header bytes ``d|dmin|scales[12]``, codes ``[n, 8, 32]``)."""
    n = x.shape[0]
    xs = x.view(n, 8, 32)
    scale, mn = _affine_fit(xs, nmax)
    d, sc = _six_bit(scale)
    dmin, mc = _six_bit(mn)
    eff_s = (d * sc).unsqueeze(-1)
    eff_m = (dmin * mc).unsqueeze(-1)
    q = torch.round((xs + eff_m) * safe_inverse(eff_s)).clamp(0, nmax).to(torch.uint8)
    header = torch.cat((f16_to_bytes(d), f16_to_bytes(dmin), _pack_scale_min_k4(sc, mc)), dim=-1)
    return header, q


def encode_q4_k(x: torch.Tensor) -> torch.Tensor:
    header, q = _encode_affine_k(x, 15)
    qs = pack_nibbles(q.view(-1, 4, 2, 32)).reshape(-1, 128)  # sub-blocks 2c, 2c+1 share bytes c*32..
    return torch.cat((header, qs), dim=-1)


def encode_q5_k(x: torch.Tensor) -> torch.Tensor:
    header, q = _encode_affine_k(x, 31)
    n = q.shape[0]
    qs = pack_nibbles((q & 0x0F).view(n, 4, 2, 32)).reshape(n, 128)
    qh = pack_bits_planes(q >> 4)  # [n, 8, 32] planes -> bit s of qh[j]
    return torch.cat((header, qh, qs), dim=-1)


def encode_q6_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    xs = x.view(n, 16, 16)
    # Sub-block scale: the largest-magnitude weight lands on -32, the code with no positive twin.
    s = (xs.gather(-1, xs.abs().argmax(dim=-1, keepdim=True)) / -32.0).squeeze(-1)  # [n, 16]
    d = _to_f16(s.abs().amax(dim=-1, keepdim=True) / 127.0)
    sc = torch.round(s * safe_inverse(d)).clamp(-128, 127)
    eff = (d * sc).unsqueeze(-1)
    q = (torch.round(xs * safe_inverse(eff)).clamp(-32, 31) + 32).to(torch.uint8).view(n, 2, 128)
    # ql: byte h*64 + k holds weights h*128 + k (low nibble) and h*128 + 64 + k (high nibble).
    ql = pack_nibbles((q & 0x0F).view(n, 2, 2, 64)).reshape(n, 128)
    # qh: byte h*32 + j holds bits 4-5 of weights h*128 + 32*s + j at bit 2*s.
    hi = (q >> 4).to(torch.int32).view(n, 2, 4, 32) << (2 * torch.arange(4, device=x.device, dtype=torch.int32)).view(
        4, 1
    )
    qh = hi.sum(dim=-2).to(torch.uint8).reshape(n, 64)
    return torch.cat((ql, qh, sc.to(torch.int8).view(torch.uint8), f16_to_bytes(d)), dim=-1)
