"""Scale and zero-point choice for integer grids, shared by int8, int4, int4-asym and gptq.

Quantizers here are round-to-nearest. For symmetric 4-bit grids the scale of each group is
picked among a few candidates around ``amax / 7.5`` by least squared error, which is worth about
1 dB of SNR on Gaussian weights over the plain ``amax / 7.5`` rule at no cost to readers: the
stored convention (``w = (q - 8) * s``) is unchanged.
"""

from __future__ import annotations

import torch

# Divisors of amax tried for a symmetric 4-bit group; 7.5 is the classic AutoGPTQ /
# compressed-tensors choice, larger ones trade clipping of the largest value for finer steps.
_SYM4_DIVISORS = (7.0, 7.25, 7.5, 7.75, 8.0, 8.25, 8.5, 9.0)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def round_to_stored(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale as the reader will see it, so codes are chosen against the stored value."""
    return scale.to(dtype).float()


def lane_sum(sq: torch.Tensor) -> torch.Tensor:
    """``sq [..., g]`` (g a multiple of 8) summed over the last dim in a fixed order, so that the engine's
    quantizers (csrc/quantize_rows.cpp), which must pick the same candidate, sum exactly as here: lane l
    of 8 adds elements 8j + l in order of j, then lanes (l, l + 4), then (l, l + 2), then the last two.
    Every step is an elementwise add, so the result does not depend on how torch vectorises a sum."""
    chunks = sq.reshape(*sq.shape[:-1], sq.shape[-1] // 8, 8)
    acc = chunks[..., 0, :]
    for j in range(1, chunks.shape[-2]):
        acc = acc + chunks[..., j, :]
    acc = acc[..., :4] + acc[..., 4:]
    acc = acc[..., :2] + acc[..., 2:]
    return acc[..., 0] + acc[..., 1]


def squared_error(w: torch.Tensor, w_hat: torch.Tensor) -> torch.Tensor:
    """Per group of the last dim ``[..., 1]``: the sum of ``(w - w_hat)^2`` in fp32, by ``lane_sum``."""
    d = w - w_hat
    return lane_sum(d * d).unsqueeze(-1)


def symmetric_int4(groups: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``groups [..., G, g]`` float -> (signed codes in -8..7 ``[..., G, g]``, scale ``[..., G]``)."""
    w = groups.float()
    amax = w.abs().amax(-1, keepdim=True)
    best_scale = None
    best_err = None
    for d in _SYM4_DIVISORS:
        s = round_to_stored(amax / d, scale_dtype)
        q = (w / _safe(s)).round().clamp(-8, 7)
        err = squared_error(w, q * s)
        if best_scale is None:
            best_scale, best_err = s, err
        else:
            better = err < best_err
            best_scale = torch.where(better, s, best_scale)
            best_err = torch.where(better, err, best_err)
    assert best_scale is not None
    q = (w / _safe(best_scale)).round().clamp(-8, 7)
    return q.to(torch.int8), best_scale.squeeze(-1)


def asymmetric_int4(
    groups: torch.Tensor, scale_dtype: torch.dtype, min_zero: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``groups [..., G, g]`` -> (codes 0..15, scale ``[..., G]``, zero point 0..15 ``[..., G]``).

    The grid spans the group's true min..max (always including 0, so an all-positive group keeps
    an exact zero), ``w = (q - z) * s``. ``min_zero=1`` serves GPTQ v1, which stores ``z - 1`` in a
    nibble and so cannot hold z = 0.
    """
    w = groups.float()
    lo = w.amin(-1, keepdim=True).clamp(max=0)
    hi = w.amax(-1, keepdim=True).clamp(min=0)
    s = round_to_stored((hi - lo) / 15.0, scale_dtype)
    z = (-lo / _safe(s)).round().clamp(min_zero, 15)
    q = ((w / _safe(s)).round() + z).clamp(0, 15)
    return q.to(torch.uint8), s.squeeze(-1), z.squeeze(-1).to(torch.uint8)


def symmetric_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> (int8 codes, fp32 scale ``[..., N, 1]`` = amax / 127)."""
    w = w.float()
    s = w.abs().amax(-1, keepdim=True) / 127.0
    q = (w / _safe(s)).round().clamp(-127, 127).to(torch.int8)
    return q, s
