"""Byte-field helpers shared by the block decoders and encoders.

Blocks arrive as a ``uint8 [nblocks, block_bytes]`` tensor. Multi-byte fields are little-endian
(as ggml writes them on every platform it supports). fp16 fields are read by copying the two
bytes into a contiguous tensor and reinterpreting them with ``.view(torch.float16)``, which is an
exact bit cast, then widened to float32 exactly as ggml's ``GGML_FP16_TO_FP32`` does.
Integer fields wider than a byte are assembled into int32 from their bytes: torch has no full
set of unsigned 16/32-bit ops, and every field we need fits in int32 once split.
"""

from __future__ import annotations

import functools

import torch


def f16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as float32 ``[nblocks, 1]``."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


def f16_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """float ``[nblocks, 1]`` -> its fp16 encoding as ``uint8 [nblocks, 2]`` (round to nearest even)."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def u16_at(blocks: torch.Tensor, offset: int, count: int = 1) -> torch.Tensor:
    """``count`` little-endian uint16 fields starting at ``offset``, as int32 ``[nblocks, count]``."""
    b = blocks[:, offset : offset + 2 * count].reshape(-1, count, 2).to(torch.int32)
    return b[..., 0] | (b[..., 1] << 8)


@functools.cache
def shifts(device: torch.device, *values: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A small constant tensor of shift amounts, cached per device so decoders do not rebuild it."""
    return torch.tensor(values, dtype=dtype, device=device)


def nibbles(x: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., n]`` -> ``uint8 [..., 2, n]``: low nibbles, then high nibbles.

    This is the ggml packing of 4-bit codes: byte ``j`` holds element ``j`` in its low nibble and
    element ``j + n`` in its high nibble.
    """
    return torch.stack((x & 0x0F, x >> 4), dim=-2)


def crumbs(x: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., n]`` -> ``uint8 [..., 4, n]``: 2-bit fields at shifts 0, 2, 4, 6."""
    return (x.unsqueeze(-2) >> shifts(x.device, 0, 2, 4, 6).view(4, 1)) & 0x03


def bits_planes(x: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., n]`` -> ``uint8 [..., 8, n]``: plane ``b`` holds bit ``b`` of every byte."""
    return (x.unsqueeze(-2) >> shifts(x.device, 0, 1, 2, 3, 4, 5, 6, 7).view(8, 1)) & 0x01


def bits_of_bytes(x: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., n]`` -> ``uint8 [..., n, 8]``: the 8 bits of every byte, LSB first."""
    return (x.unsqueeze(-1) >> shifts(x.device, 0, 1, 2, 3, 4, 5, 6, 7)) & 0x01


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nibbles`: ``[..., 2, n]`` codes (0..15) -> ``uint8 [..., n]``."""
    q = q.to(torch.uint8)
    return (q[..., 0, :] & 0x0F) | (q[..., 1, :] << 4)


def pack_bits_planes(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`bits_planes` for ``[..., P, n]`` 0/1 planes (P <= 8) -> ``uint8 [..., n]``."""
    planes = q.shape[-2]
    weights = (1 << torch.arange(planes, device=q.device, dtype=torch.int32)).view(planes, 1)
    return (q.to(torch.int32) * weights).sum(dim=-2).to(torch.uint8)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: round half away from zero (``torch.round`` rounds half to even).

    Written as ``floor(a) + floor(2 * (a - floor(a)))`` on ``a = |x|`` rather than
    ``floor(a + 0.5)``: the latter rounds ``0.49999997`` up because ``a + 0.5`` itself rounds,
    while every step here is exact in float32.
    """
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2.0 * (a - fl)))


def safe_inverse(d: torch.Tensor) -> torch.Tensor:
    """``1 / d``, with 0 where ``d == 0`` (an all-zero block quantizes to all-zero codes)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))
