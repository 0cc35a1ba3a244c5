"""Bit packing shared by the 4-bit formats.

All 4-bit conventions hetmoe reads put the code of the lower index in the lower bits: a byte holds
codes ``(2j, 2j+1)`` as ``(low nibble, high nibble)``, and an int32 holds codes ``8j .. 8j+7`` at
bits ``0, 4, .., 28``. On a little-endian host the int32 layout is exactly the byte layout viewed
as int32, which is how these helpers implement it (and why they refuse a big-endian host).
"""

from __future__ import annotations

import sys

import torch

from .base import FormatError

if sys.byteorder != "little":  # pragma: no cover - every supported CPU is little-endian
    raise ImportError("hetmoe's packed formats assume a little-endian host")


def pack_nibbles(codes: torch.Tensor, name: str = "codes") -> torch.Tensor:
    """``[..., K]`` codes in 0..15 -> ``uint8 [..., K/2]``, low nibble = even index."""
    if codes.shape[-1] % 2:
        raise FormatError(name, "an even number of codes along the last dim", f"{codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., K/2]`` -> ``uint8 [..., K]`` codes in 0..15."""
    p = packed.contiguous().view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def pack_int32(codes: torch.Tensor, name: str = "codes") -> torch.Tensor:
    """``[..., K]`` codes in 0..15 -> ``int32 [..., K/8]``, code i of a word at bits ``4i``."""
    if codes.shape[-1] % 8:
        raise FormatError(name, "a multiple of 8 codes along the last dim", f"{codes.shape[-1]}")
    packed = pack_nibbles(codes, name)
    # View through a flat copy-free reshape: a size-1 dim may carry a stride view() rejects.
    return packed.reshape(-1).view(torch.int32).reshape(*packed.shape[:-1], -1)


def unpack_int32(packed: torch.Tensor) -> torch.Tensor:
    """``int32 [..., K/8]`` -> ``uint8 [..., K]`` codes in 0..15."""
    p = packed.contiguous()
    return unpack_nibbles(p.reshape(-1).view(torch.uint8).reshape(*p.shape[:-1], -1))
