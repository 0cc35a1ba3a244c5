"""Plain float storage: F32, F16, BF16 (one element per "block").

These are not block formats, but a GGUF file stores them as raw little-endian bytes just like the
quantized types, so the same ``uint8 [..., row_bytes]`` container carries them and one code path
reads every tensor of a file.
"""

from __future__ import annotations

import torch

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def float_view(raw: torch.Tensor, name: str) -> torch.Tensor:
    """``uint8 [..., nbytes]`` reinterpreted (no copy when contiguous) as F32/F16/BF16 values."""
    return raw.contiguous().view(_DTYPES[name])


def decode_float(raw: torch.Tensor, name: str) -> torch.Tensor:
    """``uint8 [..., nbytes]`` -> float32 ``[..., nbytes / itemsize]``, a fresh tensor (never aliasing ``raw``).

    Exact for all three: fp16 and bf16 widen to float32 without rounding (bf16 is the top half of
    an fp32 bit pattern).
    """
    return float_view(raw, name).to(torch.float32, copy=True)


def encode_float(w: torch.Tensor, name: str) -> torch.Tensor:
    """float ``[..., K]`` -> ``uint8 [..., K * itemsize]``."""
    w = w.to(torch.float32).contiguous()
    if name == "F32":
        return w.view(torch.uint8).clone()
    if name == "F16":
        return w.to(torch.float16).view(torch.uint8)
    if name == "BF16":
        return _f32_to_bf16_bits(w).view(torch.uint8)
    raise AssertionError(name)


def _f32_to_bf16_bits(w: torch.Tensor) -> torch.Tensor:
    """ggml's ``ggml_compute_fp32_to_bf16``: round to nearest even, NaNs forced quiet.

    Done on the integer bit pattern (in int64, so the uint32 arithmetic cannot overflow) rather
    than with ``w.to(torch.bfloat16)`` to make the NaN payload handling ggml's by construction.
    """
    n = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    is_nan = (n & 0x7FFFFFFF) > 0x7F800000
    n = torch.where(is_nan, (n & 0xFFFF0000) | (64 << 16), n + 0x7FFF + ((n >> 16) & 1))
    # For NaN the quiet bit pattern is already in the top half; no rounding term was added.
    return (n >> 16).to(torch.int32).to(torch.int16)
