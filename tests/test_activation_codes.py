"""The integer GEMVs' activation rows (csrc/kernels_common.inc: quantize_row) against a pure-torch
statement of their codes and of every layout kernels.h names (ActQuant), byte for byte: the codes
round(x * qmax / amax) per block of 32 (ties to even, fp32 products), the scale amax / qmax, the
sums, and where each code's int16 value or int8 digits go."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import engine_isas

from hetmoe.kernels.dispatch import engine_module

NATURAL, PAIRS, QUADS, NATURAL_PAIRS, QUADS_HALVES, QUADS_K, QUADS_Q6K, QUADS_HALVES_Q4, PAIRS_HALVES = range(1, 10)
WIDE = (QUADS, NATURAL_PAIRS, QUADS_HALVES, QUADS_K, QUADS_Q6K, QUADS_HALVES_Q4)
DIGITS = (PAIRS, QUADS, PAIRS_HALVES, QUADS_HALVES, QUADS_K, QUADS_Q6K, QUADS_HALVES_Q4)
DIGIT_MAX = 32639.0  # 127 * 256 + 127: the largest code whose two digits fit int8


def tail_layout(layout: int) -> int:
    """The layout of a 512-bit row's blocks past its last whole group of 8 (kernels.h: act_tail_layout)."""
    return {QUADS: PAIRS, QUADS_HALVES_Q4: PAIRS_HALVES}.get(layout, NATURAL if layout in WIDE else layout)


def block_codes(xb: torch.Tensor, one_digit: bool) -> tuple[list[int], float]:
    """A block's codes and scale: fp32 throughout, as the engine computes them."""
    qmax = 127.0 * 256.0 if one_digit else DIGIT_MAX
    if not torch.isfinite(xb).all():
        return [0] * 32, math.nan
    amax = xb.abs().max()
    inv = (torch.tensor(127.0 if one_digit else qmax, dtype=torch.float32) / amax) if amax > 0 else torch.tensor(0.0)
    codes = torch.round(xb * inv.float()).to(torch.int64) * (256 if one_digit else 1)
    return codes.tolist(), float(amax / torch.tensor(qmax, dtype=torch.float32))


def digit_position(layout: int, b: int, nb: int, k: int) -> tuple[int, int]:
    """Byte offset of code k of block b's lo digit, and how much further its hi digit is."""
    qb = b & 3
    if layout in (PAIRS, PAIRS_HALVES):  # two blocks a unit; a row's last odd block alone
        paired = (b | 1) < nb
        first = 64 * (b & ~1) + (16 * (b & 1) if paired else 0)
        second = first + (32 if paired else 16)
        hi = 64 if paired else 32
        if layout == PAIRS:
            return (second if k & 1 else first) + k // 2, hi
        return (second if k >= 16 else first) + (k & 15), hi
    base = 64 * (b & ~3)
    if layout == QUADS:
        return base + 16 * qb + (64 if k & 1 else 0) + k // 2, 128
    if layout in (QUADS_HALVES, QUADS_HALVES_Q4):
        return base + 64 * (k >> 4) + 16 * qb + (k & 15), 128
    if layout == QUADS_K:
        return base + 64 * (qb & 1) + 32 * (qb >> 1) + k, 128
    return base + 64 * (qb >> 1) + 32 * (qb & 1) + k, 128  # QUADS_Q6K


def natural_position(layout: int, b: int, k: int) -> int:
    """int16 index of code k of block b: its block's (NATURAL) or its pair's (NATURAL_PAIRS) evens, then odds."""
    even = 32 * b if layout == NATURAL else 32 * (b & ~1) + 16 * (b & 1)
    return even + (16 if layout == NATURAL else 32) * (k & 1) + k // 2


def reference(x: torch.Tensor, layout: int, one_digit: bool) -> tuple[bytes, list[float], list[int]]:
    K = x.numel()
    nb = K // 32
    whole = nb // 8 * 8 if layout in WIDE else nb
    q = torch.full((2 * K,), 0x55, dtype=torch.uint8)
    q16 = q.view(torch.int16)
    d: list[float] = []
    sums = [0] * (K // 16 if layout == QUADS_Q6K else nb)
    for b in range(nb):
        mode = layout if b < whole else tail_layout(layout)
        codes, scale = block_codes(x[32 * b : 32 * b + 32], one_digit)
        d.append(scale)
        for k, v in enumerate(codes):
            if mode in DIGITS:
                lo = ((v + 128) & 255) - 128
                pos, hi = digit_position(mode, b, nb, k)
                q[pos] = lo & 255
                q[pos + hi] = ((v - lo) >> 8) & 255
            else:
                q16[natural_position(mode, b, k)] = v
        if mode == QUADS_Q6K:
            sums[2 * b], sums[2 * b + 1] = sum(codes[:16]), sum(codes[16:])
        else:
            sums[b] = sum(codes)
    return bytes(q.tolist()), d, sums


def row(K: int, seed: int) -> torch.Tensor:
    """Random values with the blocks that take the edge paths: all zeros, a NaN, +-Inf, and exact ties."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(K, generator=gen) * torch.logspace(-3, 2, K // 32).repeat_interleave(32)
    nb = K // 32
    x[0:32] = 0.0
    if nb > 2:
        x[32 + 5] = math.nan
        x[64 + 31] = -math.inf if seed % 2 else math.inf
    if nb > 3:  # amax DIGIT_MAX: the scale is 1, so k + 0.5 is an exact tie (to even in both directions)
        x[96:128] = torch.arange(-16, 16, dtype=torch.float32) + 0.5
        x[96] = -DIGIT_MAX
    return x.float()


LAYOUT_K = {layout: (96, 256, 768, 2880) for layout in range(1, 10)}
LAYOUT_K[QUADS_K] = LAYOUT_K[QUADS_Q6K] = (256, 768, 2048)  # the K-quants' rows are whole groups of 256


@pytest.mark.parametrize("isa", engine_isas())
@pytest.mark.parametrize("layout", range(1, 10))
@pytest.mark.parametrize("one_digit", [False, True])
def test_activation_codes_match_the_layouts(isa: str, layout: int, one_digit: bool) -> None:
    mod = engine_module()
    for K in LAYOUT_K[layout]:
        x = row(K, seed=K + layout)
        q = torch.full((2 * K,), 0x55, dtype=torch.uint8)
        d = torch.empty(K // 32)
        sums = torch.empty(K // 16 if layout == QUADS_Q6K else K // 32, dtype=torch.int32)
        mod.activation_codes(isa, x.data_ptr(), K, layout, one_digit, q.data_ptr(), d.data_ptr(), sums.data_ptr())
        want_q, want_d, want_sums = reference(x, layout, one_digit)
        where = f"{isa}, layout {layout}, K {K}, one digit {one_digit}"
        got_q = bytes(q.tolist())
        if got_q != want_q:
            first = next(i for i in range(2 * K) if got_q[i] != want_q[i])
            raise AssertionError(f"{where}: byte {first}: {got_q[first]} where {want_q[first]}")
        assert sums.tolist() == want_sums, where
        for b, (got, want) in enumerate(zip(d.tolist(), want_d, strict=True)):
            assert got == want or (math.isnan(got) and math.isnan(want)), f"{where}: block {b} scale {got}, {want}"


def test_activation_codes_rejects_a_bad_layout() -> None:
    x = torch.zeros(64)
    with pytest.raises(ValueError, match="layout 1-9"):
        engine_module().activation_codes("avx2", x.data_ptr(), 64, 10, False, 0, 0, 0)
