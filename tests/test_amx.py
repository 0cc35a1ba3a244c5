"""The AMX tile kernels (csrc/kernels_amx.cpp) and their scalar tile emulator (csrc/amx_tiles.h).

- The emulated variant ("amx-emu", any CPU with AVX-512) against a numpy model of the same arithmetic
  written from the Intel SDM (bf16 hi/lo split, TDPBF16PS's even and odd fp32 chains per row
  element, summed and added to the accumulator): bit for bit.
- Where the CPU has AMX, the hardware variant against the emulated one: bit for bit, for the tile
  GEMM alone and for whole MoE layers and linears in every method.
- Both against float64: the split's arithmetic bound (below).
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import engine_isas

from hetmoe.formats import QuantizedTensor, get_codec
from hetmoe.kernels import select_isa
from hetmoe.kernels.dispatch import engine_module
from hetmoe.runtime import CPUExperts
from hetmoe.runtime.cpu_linear import CPULinear

TILE_ISAS = [isa for isa in engine_isas() if isa in ("amx", "amx-emu")]
HAS_AMX = "amx" in TILE_ISAS
pytestmark = [
    pytest.mark.skipif(not TILE_ISAS, reason="the tile kernels need the AVX-512 unit (the emulator runs on it)"),
    pytest.mark.usefixtures("keep_isa"),
]
SHAPES = [(1, 1, 32), (13, 5, 64), (45, 37, 128), (32, 16, 96), (70, 33, 64)]  # rows, tokens, K: tails of both


def _tile_matmul(isa: str, w: torch.Tensor, x: torch.Tensor, w_lo: bool, x_lo: bool) -> torch.Tensor:
    w, x = w.float().contiguous(), x.float().contiguous()
    c = torch.empty(x.shape[0], w.shape[0])
    engine_module().tile_matmul(isa, w.data_ptr(), x.data_ptr(), w.shape[0], x.shape[0], w.shape[1], w_lo, x_lo,
                                c.data_ptr())  # fmt: skip
    return c


def _bf16(a: np.ndarray) -> np.ndarray:
    """Round fp32 to the nearest bf16 (ties to even), as fp32."""
    return torch.from_numpy(a).bfloat16().float().numpy()


def _sdm_reference(w: np.ndarray, x: np.ndarray, w_lo: bool, x_lo: bool) -> np.ndarray:
    """c [T, R] as the kernel computes it: per 32-k step the passes w_hi x_hi, w_hi x_lo, w_lo x_hi,
    each one TDPBF16PS: per (row, token), an fp32 chain over the even k of the step's 16 pairs and
    one over the odd k, then c += even + odd. bf16 products are exact in fp32, so numpy's fp32 adds
    of them are the FMAs' single roundings. (No value here is near fp32's denormals, where the
    instruction's DAZ/FTZ would matter.)"""
    w_hi, x_hi = _bf16(w), _bf16(x)
    passes = [(w_hi, x_hi)]
    if x_lo:
        passes.append((w_hi, _bf16(x - x_hi)))
    if w_lo:
        passes.append((_bf16(w - w_hi), x_hi))
    R, K = w.shape
    c = np.zeros((R, x.shape[0]), np.float32)
    for k0 in range(0, K, 32):
        for a, b in passes:
            even = np.zeros_like(c)
            odd = np.zeros_like(c)
            for kp in range(16):
                ke, ko = k0 + 2 * kp, k0 + 2 * kp + 1
                even = even + np.outer(a[:, ke], b[:, ke]).astype(np.float32)
                odd = odd + np.outer(a[:, ko], b[:, ko]).astype(np.float32)
            c = c + (even + odd)
    return c.T


def _data(R: int, T: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(R, K, generator=g), torch.randn(T, K, generator=g) * 3


@pytest.mark.parametrize(("R", "T", "K"), SHAPES)
@pytest.mark.parametrize(("w_lo", "x_lo"), [(True, True), (False, True), (True, False), (False, False)])
def test_emulator_is_the_sdm_arithmetic(R: int, T: int, K: int, w_lo: bool, x_lo: bool) -> None:
    w, x = _data(R, T, K, seed=R * T)
    got = _tile_matmul("amx-emu", w, x, w_lo, x_lo).numpy()
    want = _sdm_reference(w.numpy(), x.numpy(), w_lo, x_lo)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _digit_tiles_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The activations' int8 digits as kernels_amx.cpp's header states them, in fp32 as the kernel
    rounds: d_t = amax_t / 32639, q = round-half-even(x * (32639 / amax_t)) within +-32639,
    hi = (q + 128) >> 8, lo = q - 256 hi; B tile (j, s) row kq holds token 16 j + n's digits of
    k = 64 s + 4 kq .. 64 s + 4 kq + 3 at bytes 4 n .. 4 n + 3, tokens past T zero."""
    T, K = x.shape
    Tp = (T + 15) // 16 * 16
    amax = np.abs(x).max(axis=1)
    safe = np.where(amax > 0, amax, np.float32(1))
    inv = np.where(amax > 0, np.float32(32639) / safe, np.float32(0)).astype(np.float32)
    v = np.clip(x * inv[:, None], np.float32(-32639), np.float32(32639))
    q = np.zeros((Tp, K), dtype=np.int64)
    q[:T] = np.rint(v).astype(np.int64)
    hi = (q + 128) >> 8
    lo = q - 256 * hi
    tiles = [d.reshape(Tp // 16, 16, K // 64, 16, 4).transpose(0, 2, 3, 1, 4).astype(np.int8).ravel() for d in (hi, lo)]
    d = np.zeros(Tp, dtype=np.float32)
    d[:T] = np.where(amax > 0, amax / np.float32(32639), np.float32(0))
    return tiles[0], tiles[1], d


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize(("T", "K"), [(1, 64), (5, 128), (37, 192), (16, 640)])
@pytest.mark.parametrize("two_step", [False, True])
def test_activation_digits_are_the_stated_split(isa: str, T: int, K: int, two_step: bool) -> None:
    """amx_pack_i8, and its two steps (a MoE's gate and up: each token's digit rows once in phase 0,
    then every expert's tiles gathered from them), bit for bit against the stated convention; one row
    is all zeros (d = 0, digits 0)."""
    g = torch.Generator().manual_seed(T * 1000 + K)
    x = (torch.randn(T, K, generator=g) * torch.rand(T, 1, generator=g) * 4).numpy()
    x[T // 2] = 0
    n = (T + 15) // 16 * 16 * K
    hi, lo = np.empty(n, dtype=np.int8), np.empty(n, dtype=np.int8)
    d = np.empty((T + 15) // 16 * 16, dtype=np.float32)
    engine_module().tile_pack_digits(isa, x.ctypes.data, T, K, two_step, hi.ctypes.data, lo.ctypes.data, d.ctypes.data)
    ref_hi, ref_lo, ref_d = _digit_tiles_reference(x)
    assert np.array_equal(hi, ref_hi) and np.array_equal(lo, ref_lo) and np.array_equal(d, ref_d)


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX: the hardware variant is not run here")
@pytest.mark.parametrize(("R", "T", "K"), [*SHAPES, (96, 200, 2048)])
@pytest.mark.parametrize(("w_lo", "x_lo"), [(True, True), (False, False)])
def test_hardware_tiles_equal_the_emulator(R: int, T: int, K: int, w_lo: bool, x_lo: bool) -> None:
    w, x = _data(R, T, K, seed=R + T)
    assert torch.equal(_tile_matmul("amx", w, x, w_lo, x_lo), _tile_matmul("amx-emu", w, x, w_lo, x_lo))


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize(("R", "T", "K"), SHAPES)
def test_split_keeps_fp32_accuracy(isa: str, R: int, T: int, K: int) -> None:
    """Against float64, per element, relative to sum_k |w x|: the split drops w_lo x_lo and rounds
    both lo terms to bf16, each at most 2^-18 of a product (3 * 2^-18 in all), and the fp32 chains
    add at most K/2 + 2 roundings of 2^-24 each (their partial sums never exceed sum |w x|)."""
    w, x = _data(R, T, K, seed=7 * R + T)
    got = _tile_matmul(isa, w, x, True, True).double()
    ref = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    bound = 3 * 2.0**-18 + (K / 2 + 2) * 2.0**-24
    assert float(((got - ref).abs() / scale).max()) <= bound


@pytest.mark.skipif(not HAS_AMX, reason="this CPU has no AMX: the hardware variant is not run here")
@pytest.mark.parametrize(
    "method",
    [
        "bf16",
        "int8",
        "int4",
        "mxfp4",
        "fp8",
        "gguf:q4_k",
        "gguf:q5_k",
        "gguf:q6_k",
        "gguf:q8_0",
        "gguf:q4_0",
        "gguf:q5_0",
    ],
)
def test_engines_on_hardware_tiles_equal_the_emulator(method: str) -> None:
    """Whole MoE layers (every expert on the tile path) and linears, hardware against emulator."""
    E, H, I, T = 4, 512, 256, 40  # noqa: E741
    g = torch.Generator().manual_seed(5)
    codec = get_codec(method)
    weights = [codec.quantize(torch.randn(*s, generator=g) * 0.05) for s in ((E, I, H), (E, I, H), (E, H, I))]
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    rw = torch.rand(T, 2, generator=g)
    out = {}
    for isa in ("amx", "amx-emu"):
        select_isa(isa)
        moe = CPUExperts(*weights, gemv_max_tokens=0)
        lin = CPULinear(codec.quantize(torch.randn(80, H, generator=torch.Generator().manual_seed(6)) * 0.05),
                        gemv_max_tokens=0)  # fmt: skip
        assert moe.isa == isa
        out[isa] = (moe.forward(x, ids, rw), moe.forward(x.bfloat16(), ids, rw), lin(x), lin(x.bfloat16()))
    for a, b in zip(out["amx"], out["amx-emu"], strict=True):
        assert torch.equal(a, b)


def test_auto_never_selects_the_emulator(monkeypatch) -> None:
    monkeypatch.delenv("HETMOE_ISA", raising=False)  # "auto" is HETMOE_ISA where that is set
    assert engine_module().best_isa() != "amx-emu"
    assert select_isa("auto") != "amx-emu"


def _tile_linear(isa: str, method: str, params: dict, K: int, rows: int = 80) -> tuple:
    """`rows` random rows of K in `method` and 70 tokens through CPULinear on the tile path of `isa`: the
    stored weights, the activations, the dequantized weights (float64), the output and float64's."""
    select_isa(isa)
    g = torch.Generator().manual_seed(11)
    codec = get_codec(method, **params)
    q = codec.quantize(torch.randn(rows, K, generator=g) * 0.05)
    x = torch.randn(70, K, generator=g)
    lin = CPULinear(q, gemv_max_tokens=0)
    assert lin.isa == isa
    w = codec.dequantize(q).double()
    return q, x, w, lin(x).double(), x.double() @ w.T


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize(
    ("method", "params", "K"),
    [
        ("int4", {"group_size": 32}, 608),  # K not a multiple of 64: the bf16 code tiles, not the digits
        ("int4-asym", {"group_size": 32}, 608),
        ("gguf:q4_0", {}, 608),
        ("gguf:q4_k", {}, 768),  # K-quants' K is a multiple of 256: Q4_K takes the digits unless told (below)
        ("gguf:q5_k", {}, 768),
        ("gguf:q8_0", {}, 608),  # 8-bit codes on the same tiles: |code| <= 128 is as exact in bf16
    ],
)
def test_code_tiles_keep_fp32_accuracy(isa: str, method: str, params: dict, K: int) -> None:
    """4-bit rows and Q8_0's on bf16 tiles (kernels_amx.cpp, gemm_nibble_t): the code values (code - zero,
    Q8_0's int8 codes) are exact bf16, so per element, relative to sum_k |w x| against float64: the
    activations' split drops at most 2^-18 of each product; each span of k sharing a scale adds its
    fp32 chains' at most span / 2 + 2 roundings (span <= 256 <= K / 2), one for the scale and one into
    the accumulator (K / 32 spans at most), each 2^-24 of a sum no larger than sum_k |w x|. 80 rows
    (two 32-row blocks and a 16-row one), 70 tokens (three token-tile pairs, the last one single),
    K not a multiple of the 256-column chunk where the format allows (608: a 96-column tail; the
    K-quants' superblocks of 256 make it 768).
    Q4_K's and Q5_K's weights are d * sc * code - dmin * m: the min term, dmin * m (exact in fp32) times the
    activations' fp32 sum over the sub-block (31 roundings), is subtracted in one more rounding, so
    its sums are measured against sum_k |x| (|w| + |dmin m|), with 33 more roundings of 2^-24, and
    2 for the fp32 weights the reference dequantizes (each rounded from d * sc * code - dmin * m).
    Q4_K rows run on the code tiles only under HETMOE_AMX_4BIT=codes, which the engine reads once a
    process: that case runs in a process of its own."""
    if method == "gguf:q4_k":
        env = {**os.environ, "HETMOE_AMX_4BIT": "codes", "HETMOE_TUNE": "0"}
        code = f"import test_amx; test_amx._check_code_tiles({isa!r}, {method!r}, {params!r}, {K})"
        run = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=Path(__file__).parent, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-2000:]
        return
    _check_code_tiles(isa, method, params, K)


def _check_code_tiles(isa: str, method: str, params: dict, K: int, rows: int = 80) -> None:
    q, x, w, got, ref = _tile_linear(isa, method, params, K, rows)
    magnitude = w.abs()
    extra = 0
    if method in ("gguf:q4_k", "gguf:q5_k"):  # the codes zeroed leave -dmin * m in every weight's place
        blocks = q.tensors[".weight"].clone().view(rows, -1, 144 if method == "gguf:q4_k" else 176)
        blocks[:, :, 16:] = 0
        zeroed = QuantizedTensor(q.method, q.shape, {".weight": blocks.view(rows, -1)}, q.params)
        mins = get_codec(method).dequantize(zeroed)
        magnitude = magnitude + mins.double().abs()
        extra = 33 + 2
    scale = x.double().abs() @ magnitude.T
    bound = 2.0**-18 + (K / 2 + 4 + K / 32 + extra) * 2.0**-24
    assert float(((got - ref).abs() / scale).max()) <= bound


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_q6k_without_its_digits_takes_the_panels(isa: str) -> None:
    """Q6_K has no bf16 code tiles: under HETMOE_AMX_4BIT=codes (no digit tiles) its rows go through
    dequantized fp32 panels split into bf16 hi + lo, as do the methods without a tile path. Per
    element, relative to sum_k |w x| against float64 of the codec's fp32 weights: the two splits drop
    at most 3 * 2^-18 of a product, the fp32 chains add at most K / 2 + 2 roundings of 2^-24, and the
    panel's weight d * sc * (code - 32) may round differently from the codec's (one more 2^-24 of
    each |w|, on both sides: 2)."""
    env = {**os.environ, "HETMOE_AMX_4BIT": "codes", "HETMOE_TUNE": "0"}
    code = f"import test_amx; test_amx._check_panels({isa!r}, 'gguf:q6_k', 768)"
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=Path(__file__).parent, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]


def _check_panels(isa: str, method: str, K: int) -> None:
    _q, x, w, got, ref = _tile_linear(isa, method, {}, K)
    scale = x.double().abs() @ w.abs().T
    bound = 3 * 2.0**-18 + (K / 2 + 2 + 2) * 2.0**-24
    assert float(((got - ref).abs() / scale).max()) <= bound


def _q4k_row_reach(q: QuantizedTensor) -> torch.Tensor:
    """Each Q4_K row's largest |w| any codes could give: its weights dequantized with every code 0 and
    with every code 15 (the codec's own arithmetic, fp32), the larger magnitude of the two, per row."""
    ends = []
    for code in (0x00, 0xFF):
        blocks = q.tensors[".weight"].clone().view(q.shape[0], -1, 144)
        blocks[:, :, 16:] = code
        ends.append(
            get_codec(q.method).dequantize(
                QuantizedTensor(q.method, q.shape, {".weight": blocks.view(q.shape[0], -1)}, q.params)
            )
        )
    return torch.maximum(ends[0].double().abs(), ends[1].double().abs()).amax(dim=1)


def _row_scale_max(q: QuantizedTensor) -> torch.Tensor:
    """Each row's largest |scale| as the format stores it (mxfp4: 2^(e - 127), the E2M1 values' own)."""
    t = q.tensors
    if q.method == "gguf:q6_k":  # 210-byte superblocks: 16 int8 scales at byte 192, fp16 d at 208
        blocks = t[".weight"].view(q.shape[0], -1, 210)
        sc = blocks[:, :, 192:208].contiguous().view(torch.int8).double()
        d = blocks[:, :, 208:210].contiguous().view(torch.float16).double()
        return (sc * d).abs().amax(dim=(1, 2))
    if q.method in ("gguf:q4_0", "gguf:q8_0"):
        block = 18 if q.method == "gguf:q4_0" else 34
        d = t[".weight"].view(q.shape[0], -1, block)[:, :, :2].contiguous().view(torch.float16)
        return d.double().abs().amax(dim=(1, 2))
    if q.method == "mxfp4":
        return (2.0 ** (t["_scales"].double() - 127)).amax(dim=1)
    if q.method == "gptq":
        return t[".scales"].double().abs().amax(dim=0)
    return t[".weight_scale"].double().abs().amax(dim=1)


@pytest.mark.parametrize("isa", TILE_ISAS)
@pytest.mark.parametrize(
    ("method", "params", "K", "span"),
    [
        ("int4", {"group_size": 32}, 640, 8),
        ("int4", {"group_size": 128, "layout": "compressed-tensors"}, 640, 8),
        ("int4", {"group_size": 256}, 768, 8),
        ("int4-asym", {"group_size": 64}, 640, 16),
        ("gptq", {"group_size": 128, "sym": False}, 640, 16),
        ("gguf:q4_0", {}, 640, 8),
        ("gguf:q8_0", {}, 640, 128),  # int8 codes, |v| <= 128
        ("gguf:q6_k", {}, 768, 32),  # code - 32 in [-32, 31], a scale (d * sc) per 16 weights
        ("mxfp4", {}, 640, 8),
        ("gguf:q4_k", {}, 768, 0),
    ],
)
def test_digit_tiles_keep_int16_accuracy(isa: str, method: str, params: dict, K: int, span: int) -> None:
    """4-bit rows, Q6_K's and Q8_0's as two int8 digits a weight on TDPBSSD (kernels_amx.cpp, gemm_digits_t), against
    float64, per element. A row's weights become integers on one unit U = W / 32639, where W is
    `span` times the row's largest |scale| (8 where the code values are within [-8, 8], 16 where
    within [-16, 16]: code - zero; twice an E2M1 value against half its scale; 32 for Q6_K's code - 32;
    128 for Q8_0's int8 codes), each within one unit;
    the activations are integers on d_t = amax_t / 32639, within half a unit. So the error is at most
    W / 32639 sum_k |x_k| + amax_t / 65278 sum_k |w_k| + K 2^14 U d_t (the dropped product of the two
    low digits, each at most 128) + 5 fp32 roundings of the int32 sums' conversion and scaling, each
    2^-24 of at most K W amax_t. 80 rows (two 32-row blocks and a 16-row one), 70 tokens (five token
    tiles, the last one short).
    Q4_K (span 0) puts each sub-block's min into its digits: w = d sc code - dmin m, so W is the row's
    largest |w| over codes 0 and 15 (the ends of a line in the code), each sub-block's table value within
    one unit as well (kernels_amx.cpp: q4k_digit_row)."""
    _check_digit_tiles(isa, method, params, K, span)


def _check_digit_tiles(isa: str, method: str, params: dict, K: int, span: int, rows: int = 80) -> None:
    q, x, w, got, ref = _tile_linear(isa, method, params, K, rows)
    W = span * _row_scale_max(q) if span else _q4k_row_reach(q)  # [rows]
    amax = x.double().abs().amax(dim=1, keepdim=True)  # [tokens, 1]
    bound = (
        x.double().abs().sum(dim=1, keepdim=True) * W / 32639
        + amax / 65278 * w.abs().sum(dim=1)
        + K * 2.0**14 * W * amax / 32639**2
        + 5 * 2.0**-24 * K * W * amax
    )
    assert bool(((got - ref).abs() <= bound).all())


@pytest.mark.parametrize("isa", TILE_ISAS)
def test_few_rows_pack_their_tokens_in_their_items(isa: str) -> None:
    """20 rows, one panel: a single row item, so the linear job splits the 70 tokens into chunks, each
    packed by its one item (linear_engine.cpp: own_tiles) where 80 rows' chunks are packed in a phase of
    their own. Q5_K's code tiles with their block sums, and int4's digits, at the bounds of the tests
    above (per element, which the row count does not change)."""
    _check_code_tiles(isa, "gguf:q5_k", {}, 768, rows=20)
    _check_digit_tiles(isa, "int4", {"group_size": 32}, 640, 8, rows=20)
