"""Ternary types TQ1_0 and TQ2_0: weights in {-1, 0, +1} times one fp16 scale per 256.

* TQ2_0 (66 bytes): ``qs[64] | d``, 2-bit codes ``c`` (value ``c - 1``), the four fields of a
  byte 32 weights apart within each 128-weight half.
* TQ1_0 (54 bytes): ``qs[48] | qh[4] | d``, five trits per byte (four in ``qh``) stored as a
  fixed-point fraction: trit ``k`` of byte ``x`` is the integer part of ``3 * (x * 3**k mod 256) / 256``.
  The first 32 bytes give 160 weights (trit-major, 32 apart), the next 16 bytes 80, ``qh`` 16.
"""

from __future__ import annotations

import torch

from ._fields import crumbs, f16_at, shifts


def decode_tq2_0(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    out.copy_(crumbs(b[:, 0:64].reshape(n, 2, 32)).reshape(n, 256)).sub_(1.0).mul_(f16_at(b, 64))


def _trits(x: torch.Tensor, count: int) -> torch.Tensor:
    """``uint8 [n, m]`` -> int ``[n, count * m]``: trit ``k`` of byte ``j`` lands at ``k * m + j``."""
    pow3 = shifts(x.device, 1, 3, 9, 27, 81)[:count].view(count, 1)
    # uint8 multiply wraps mod 256, which is exactly the "shift the fraction left by a trit" step.
    frac = (x.unsqueeze(-2) * pow3).to(torch.int32)
    return ((frac * 3) >> 8).reshape(x.shape[0], -1)


def decode_tq1_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = torch.cat((_trits(b[:, 0:32], 5), _trits(b[:, 32:48], 5), _trits(b[:, 48:52], 4)), dim=-1)
    out.copy_(q).sub_(1.0).mul_(f16_at(b, 52))
