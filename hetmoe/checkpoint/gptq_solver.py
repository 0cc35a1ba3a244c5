"""GPTQ: quantize one linear weight with second-order error compensation, given its input Hessian.

The layer's output error on inputs ``X`` is ``||X (W - Q)^T||^2``, a quadratic form in the
Hessian ``H = 2 X^T X / n``. GPTQ (Frantar et al., 2022) rounds the input columns one at a time
and spreads each column's rounding error over the columns not yet rounded, weighted by the
inverse Hessian, so later columns absorb what earlier ones lost. Columns are processed in blocks
(the update of columns past the block is one matrix product per block, the "lazy batch"
form), the Hessian is dampened by a fraction of its mean diagonal so the Cholesky factorisation
is stable, and each group's grid (scale, zero point) is chosen when the group's first column is
reached, from the weights as error compensation has left them, by the codec's own rule.

With a diagonal Hessian no error crosses columns and the result is exactly round-to-nearest:
the codes differ only where the inputs are correlated, which is where GPTQ earns its keep.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..formats.base import QuantizedTensor
from ..formats.gptq import GPTQCodec

DEFAULT_DAMP = 0.01
DEFAULT_BLOCK = 128
# Dampening is raised by this factor, at most this many times, when H is numerically not positive
# definite (a handful of calibration tokens for a wide layer).
_DAMP_RETRY_FACTOR = 10.0
_DAMP_RETRIES = 4
# Output errors are measured on this many evenly spaced rows (a multiple of 8, as the codec wants):
# tr(dW H dW^T) costs N*K^2, more than GPTQ itself, while rows' energies just add up.
STAT_ROWS = 64


@dataclass
class SolveStats:
    """What GPTQ did to one weight: output error on the calibration inputs, GPTQ against RTN."""

    output_snr_db: float  # 10*log10(tr(W H W^T) / tr(dW H dW^T)) for the GPTQ codes (on STAT_ROWS rows)
    rtn_output_snr_db: float  # the same for round-to-nearest on the same grid rule
    damp: float  # the dampening fraction finally used
    dead_inputs: int  # input channels the calibration data never activated


def output_snr_db(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """Output SNR in dB on the calibration inputs, from ``H``: ``tr(W H W^T) / tr(dW H dW^T)``."""
    return _snr_from_energies(_energy(weight.float(), hessian), _energy(weight.float() - approx.float(), hessian))


def _energy(w: torch.Tensor, hessian: torch.Tensor) -> float:
    """``tr(w H w^T)``: the squared output norm of ``w`` on the calibration inputs (up to 2/n)."""
    return float(((w @ hessian.float()) * w).sum(dtype=torch.float64))


def _snr_from_energies(signal: float, noise: float) -> float:
    if noise <= 0.0:
        return math.inf
    if signal <= 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _inverse_hessian_factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of ``(H + damp*mean(diag H)*I)^-1``, raising ``damp`` until it exists."""
    mean_diag = float(torch.diag(h).mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    for _ in range(_DAMP_RETRIES + 1):
        damped = h + (damp * mean_diag) * eye
        factor, info = torch.linalg.cholesky_ex(damped)
        if int(info) == 0:
            # H^-1 = L^-T L^-1 from one triangular solve and a product: several times faster on the
            # CPU than torch.cholesky_inverse (LAPACK potri), with the same result to float rounding.
            factor_inv = torch.linalg.solve_triangular(factor, eye, upper=False)
            upper, info = torch.linalg.cholesky_ex(factor_inv.t() @ factor_inv, upper=True)
            if int(info) == 0:
                return upper, damp
        damp *= _DAMP_RETRY_FACTOR
    raise ValueError(f"the Hessian is not positive definite even with dampening {damp:g}")


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    codec: GPTQCodec,
    damp: float = DEFAULT_DAMP,
    block_size: int = DEFAULT_BLOCK,
    name: str = "weight",
) -> tuple[QuantizedTensor, SolveStats]:
    """GPTQ codes for ``weight [N, K]`` given the Hessian ``[K, K]`` of its inputs, stored by ``codec``."""
    w_orig = weight.float()
    n, k = w_orig.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"{name}: Hessian shape {list(hessian.shape)} does not match K={k}")
    codec._check_shape((n, k), name)
    g = k if codec.group_size == -1 else codec.group_size
    h = hessian.float().clone()
    dead = torch.diag(h) == 0
    # A channel the calibration text never activated carries no information: give it a unit
    # curvature so it is rounded on its own (its weights are kept, unlike zeroing them, so inputs
    # that do use it later are still served).
    h[dead, dead] = 1.0
    upper, used_damp = _inverse_hessian_factor(h, damp)

    # Blocks hold whole groups, so a group's grid is always taken from compensated weights.
    block = g if g >= block_size else block_size - block_size % g
    w = w_orig.clone()
    codes = torch.empty((n, k), dtype=torch.float32)
    scales = torch.empty((n, k // g), dtype=torch.float32)
    zeros = torch.empty((n, k // g), dtype=torch.uint8)
    scale = safe = zero = torch.empty(0)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = upper[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                grid_scale, grid_zero = codec.group_grid(w1[:, i : i + g].unsqueeze(1))
                scale = grid_scale[:, 0]
                safe = torch.where(scale > 0, scale, torch.ones_like(scale))
                zero = grid_zero[:, 0].float()
                scales[:, col // g] = scale
                zeros[:, col // g] = grid_zero[:, 0]
            column = w1[:, i]
            # Rounded exactly as the codec's round-to-nearest does: (w / s).round() + z, clamped.
            q = torch.div(column, safe).round_().add_(zero).clamp_(0, 15)
            codes[:, col] = q
            err = column.sub((q - zero).mul_(scale)).div_(u1[i, i])
            w1[:, i:].addr_(err, u1[i, i:], alpha=-1.0)  # spread the error over the block's later columns
            err1[:, i] = err
        w[:, i2:].addmm_(err1, upper[i1:i2, i2:], alpha=-1.0)  # and, lazily, over the columns past it

    quantized = codec.pack(codes.to(torch.uint8), scales, zeros)
    rows = torch.linspace(0, n - 1, STAT_ROWS).round().long() if n > STAT_ROWS else torch.arange(n)
    w_rows = w_orig[rows]
    approx = codec.dequantize(quantized)[rows]
    rtn = codec.dequantize(codec.quantize(w_rows, name))
    signal = _energy(w_rows, hessian)
    stats = SolveStats(
        output_snr_db=_snr_from_energies(signal, _energy(w_rows - approx, hessian)),
        rtn_output_snr_db=_snr_from_energies(signal, _energy(w_rows - rtn, hessian)),
        damp=used_damp,
        dead_inputs=int(dead.sum()),
    )
    return quantized, stats
