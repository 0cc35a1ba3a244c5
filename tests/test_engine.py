"""The compiled CPU engine against the pure-torch reference, on every ISA variant this CPU runs.

Bounds (relative L2 error against the float64 reference on the same stored weights):
- fp32 activations: 1e-5 for bf16 weights (fp32 math throughout) and 3e-4 for int8/int4, whose
  decode kernels quantize activations to int16 per block of 32 (~1e-5 per element; measured
  ~5e-5 end to end);
- bf16 activations and output: 5e-3. One bf16 rounding (8 significant bits) is at most 2^-8 = 3.9e-3
  relative and ~1.6e-3 RMS (measured 1.65e-3 where the output is the only one); where the CPU has
  AVX512-BF16 the GEMM path also rounds the dequantized weights of both projections and the
  intermediate (what a bf16 model computes with): four independent roundings, ~3.3e-3 RMS (measured
  3.4e-3 to 3.9e-3 for int4, int8, fp8, Q4_0, Q4_K, Q6_K);
- on AMX tiles (amx, amx-emu), the GEMM path's fp32 bound is two chained tile GEMMs' split error
  (conftest.TILE_GEMM_BOUND) where that exceeds the method's.
"""

import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import TILE_GEMM_BOUND, TILE_ISAS, engine_isas

from hetmoe.formats import QuantizedTensor, get_codec
from hetmoe.kernels import moe_forward_reference, select_isa
from hetmoe.kernels.dispatch import engine_module, int_vector_bits, set_int_vector_bits
from hetmoe.runtime import CPUExperts

E, H, I = 8, 640, 256  # noqa: E741 - neither a multiple of the 24-row panels (tails exercised); both of 128
FP32_BOUND = {
    "bf16": 1e-5,
    "fp8": 1e-5,
    "fp8-channel": 1e-5,
    "int8": 3e-4,
    "int4": 3e-4,
    "int4-asym": 3e-4,
    "gptq": 3e-4,
    "mxfp4": 3e-4,
}
BF16_BOUND = 5e-3


def _fp32_bound(method: str, isa: str) -> float:
    return max(FP32_BOUND[method], 2 * TILE_GEMM_BOUND) if isa in TILE_ISAS else FP32_BOUND[method]


ISAS = engine_isas()
pytestmark = pytest.mark.usefixtures("keep_isa")


@pytest.fixture(scope="module")
def weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(E, I, H, generator=g) * 0.05,
        torch.randn(E, I, H, generator=g) * 0.05,
        torch.randn(E, H, I, generator=g) * 0.05,
    )


def _codec_params(method: str, group: int, layout: str) -> dict:
    if method in ("int4", "int4-asym"):
        return {"group_size": group, "layout": layout}
    if method == "gptq":  # layout doubles as "sym,format" here
        sym, fmt = (layout if "," in layout else "sym,gptq").split(",")
        return {"group_size": group, "sym": sym == "sym", "checkpoint_format": fmt}
    return {}


_QUANTIZED: dict[tuple, list] = {}


def _experts(weights, method: str, group: int = 32, layout: str = "bytes", **kw) -> CPUExperts:
    key = (id(weights), method, group, layout)
    if key not in _QUANTIZED:  # quantize each configuration once per session
        codec = get_codec(method, **_codec_params(method, group, layout))
        _QUANTIZED[key] = [codec.quantize(w) for w in weights]
    return CPUExperts(*_QUANTIZED[key], **kw)


def _reference(ce: CPUExperts, x, ids, w, skip=None, **kw):
    deq = [get_codec(q.method, **q.params).dequantize(q) for q in (ce.gate, ce.up, ce.down)]
    return moe_forward_reference(x, *deq, ids, w, skip, **kw)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _routing(T: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    return ids, torch.rand(T, k, generator=g)


CONFIGS = [
    ("bf16", 32, "bytes"),
    ("int8", 32, "bytes"),
    ("int4", 32, "bytes"),
    ("int4", 64, "bytes"),
    ("int4", 128, "compressed-tensors"),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("method", "group", "layout"), CONFIGS)
def test_matches_reference(weights, isa: str, method: str, group: int, layout: str) -> None:
    """Both paths (GEMV for few tokens per expert, dequantized-panel GEMM for many) and their mix."""
    select_isa(isa)
    for gemv_max in (0, 4, 1000):  # all GEMM, mixed, all GEMV
        ce = _experts(weights, method, group, layout, gemv_max_tokens=gemv_max)
        assert ce.isa == isa
        for T, k in ((1, 4), (7, 8), (37, 3)):
            ids, w = _routing(T, k, seed=T)
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
            ref = _reference(ce, x, ids, w)
            assert _rel(ce.forward(x, ids, w), ref) < _fp32_bound(method, isa), (gemv_max, T, k)
            if T == 7:
                xb = x.bfloat16()
                yb = ce.forward(xb, ids, w)
                assert yb.dtype == torch.bfloat16
                assert _rel(yb, _reference(ce, xb.float(), ids, w)) < BF16_BOUND, (gemv_max, T, k)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method", ["bf16", "int8", "int4", "gptq", "mxfp4", "fp8"])
def test_adversarial_routing(weights, isa: str, method: str) -> None:
    select_isa(isa)
    ce = _experts(weights, method)
    bound = _fp32_bound(method, isa)
    x = torch.randn(45, H, generator=torch.Generator().manual_seed(3))
    # Every token to one expert (the rest idle), and k = 1.
    ids = torch.full((45, 1), 5, dtype=torch.int64)
    w = torch.rand(45, 1)
    assert _rel(ce.forward(x, ids, w), _reference(ce, x, ids, w)) < bound
    # -1 ids skip a slot; a token whose slots are all -1 gets zeros.
    ids, w = _routing(45, 3)
    ids[::4, 1] = -1
    ids[7] = -1
    y = ce.forward(x, ids, w)
    assert torch.count_nonzero(y[7]) == 0
    assert _rel(y, _reference(ce, x, ids, w)) < bound
    # Masked experts (computed elsewhere) contribute nothing.
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[0, 3, 6]] = True
    ce.set_mask(mask)
    assert _rel(ce.forward(x, ids, w), _reference(ce, x, ids, w, skip=mask)) < bound
    ce.set_mask(torch.ones(E, dtype=torch.bool))
    assert torch.count_nonzero(ce.forward(x, ids, w)) == 0
    # No tokens at all.
    assert ce.forward(x[:0], ids[:0], w[:0]).shape == (0, H)


@pytest.mark.parametrize("isa", [i for i in ISAS if i in TILE_ISAS])
@pytest.mark.parametrize("method", ["bf16", "int8", "int4", "fp8"])
@pytest.mark.parametrize("absent", [3, None])
def test_tile_experts_of_many_token_tiles(weights, isa: str, method: str, absent: int | None) -> None:
    """A prefill whose tile-path experts hold several 16-token tiles each, in unequal numbers, beside an
    expert on the GEMV path. Each expert's tokens and intermediate rows are packed once, at offsets that
    differ per expert, in phases of their own where an expert has several items, else by its one item
    (engine::GroupTiles; on 2 threads 7 active experts get two items each, 8 one). fp32 activations
    (bf16 hi and lo, or digits) and bf16 ones (hi only), against the float64 reference at the paths'
    bounds."""
    select_isa(isa)
    ce = _experts(weights, method, gemv_max_tokens=20)
    g = torch.Generator().manual_seed(11)
    T, k = 150, 4
    # expert e drawn with weight (e + 1)^2, `absent` never (a gap among the active ones), expert 0 by
    # five tokens only (below gemv_max: the GEMV path)
    p = torch.arange(1, E + 1, dtype=torch.float).pow(2)
    p[0] = 0.0
    if absent is not None:
        p[absent] = 0.0
    ids = torch.stack([torch.multinomial(p, k, generator=g) for _ in range(T)])
    ids[:5, -1] = 0
    counts = torch.bincount(ids.flatten(), minlength=E)
    assert 0 < counts[0] <= 20 and (counts > 32).sum() >= 4, counts
    assert (counts > 0).sum() == (E - 1 if absent is not None else E), counts
    w = torch.rand(T, k, generator=g)
    x = torch.randn(T, H, generator=g)
    assert _rel(ce.forward(x, ids, w), _reference(ce, x, ids, w)) < _fp32_bound(method, isa)
    xb = x.bfloat16()
    assert _rel(ce.forward(xb, ids, w), _reference(ce, xb.float(), ids, w)) < BF16_BOUND


def test_avx2_and_avx512_agree(weights) -> None:
    if "avx512" not in ISAS:
        pytest.skip("this CPU has no AVX-512")
    ids, w = _routing(19, 4)
    x = torch.randn(19, H, generator=torch.Generator().manual_seed(9))
    outs = []
    for isa in ("avx2", "avx512"):
        select_isa(isa)
        outs.append(_experts(weights, "int4").forward(x, ids, w))
    assert _rel(outs[0], outs[1]) < 1e-5


@pytest.mark.parametrize(
    ("method", "group"),
    [("int4", 32), ("int4", 256), ("int4-asym", 64), ("int4-asym", 256), ("gptq", 128), ("mxfp4", 32)]
    + [
        (m, 32)
        for m in (
            "int8",
            "gguf:q4_0",
            "gguf:q5_0",
            "gguf:q8_0",
            "gguf:q4_k",
            "gguf:q5_k",
            "gguf:q6_k",
            "gguf:iq4_xs",
            "gguf:iq4_nl",
        )
    ],
)
def test_gemv_widths_agree(method: str, group: int) -> None:
    """The AVX-512 variant's GEMVs at 256 and 512 bits wide (the nibble formats four blocks a vector,
    the natural-order ones two): the same dot products summed in another order. Gate and up (K = 512)
    take the 512-bit loop; down (K = 416 for groups of 32: 13 blocks, one whole group of 8) the
    512-bit loop for its first 8 blocks and the 256-bit one for the other 5 (an odd count: the pairs
    layout's last block unpaired), the activations quantized in each part's layout (groups of 64 and
    128: K = 448 and 384); with groups of 256 and the 256-weight GGUF blocks K = 768 (whole groups)."""
    if "avx512" not in ISAS:
        pytest.skip("this CPU has no AVX-512")
    g = torch.Generator().manual_seed(3)
    inter = {32: 416, 64: 448, 128: 384}.get(group, 768)  # a tail of 5, 6 and 4 blocks (whole groups of 64, 128)
    if method in ("gguf:q4_k", "gguf:q5_k", "gguf:q6_k", "gguf:iq4_xs"):
        inter = 768
    w = [torch.randn(4, inter, 512, generator=g) * 0.05 for _ in range(2)]
    w.append(torch.randn(4, 512, inter, generator=g) * 0.05)
    codec = get_codec(method, **({} if method.startswith("gguf:") else _codec_params(method, group, "bytes")))
    select_isa("avx512")
    ce = CPUExperts(*(codec.quantize(t) for t in w), gemv_max_tokens=1000)
    try:
        for T in (1, 3, 6):
            gen = torch.Generator().manual_seed(T)
            ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(T)])
            weights_t = torch.rand(T, 2, generator=gen)
            x = torch.randn(T, 512, generator=gen)
            outs = []
            for bits in (256, 512):
                set_int_vector_bits(bits)
                assert int_vector_bits() == bits
                outs.append(ce.forward(x, ids, weights_t))
            assert _rel(outs[1], _reference(ce, x, ids, weights_t)) < FP32_BOUND.get(method, 3e-4), T
            # fp32 sums in another order move the intermediate by ulps, which can flip the rounding of
            # its int16 codes for the down projection: ~1e-5 apart, where a wrong block would be ~1e-1.
            assert _rel(outs[0], outs[1]) < 5e-5, T
    finally:
        set_int_vector_bits(0)
    with pytest.raises(ValueError, match="expected 256, 512 or 0"):
        set_int_vector_bits(384)


def test_each_family_and_regime_runs_at_its_own_width() -> None:
    """The integer GEMVs' width is set per family (4-bit digits, int16 codes) and regime (decode: at
    most 4 tokens an expert; prompt: more): a job runs at the width of its family in its regime. Seen
    in the results: the 256- and 512-bit loops sum in different orders, so each width's output is its
    own, bit for bit (checked first: were they equal, this test could not tell them apart). bf16's
    family: test_bf16_gemv_runs_at_its_familys_width."""
    if "avx512" not in ISAS:
        pytest.skip("this CPU has no AVX-512")
    select_isa("avx512")  # before the engines are made: each keeps the variant selected then
    g = torch.Generator().manual_seed(3)
    w = [torch.randn(8, 256, 512, generator=g) * 0.05 for _ in range(2)]
    w.append(torch.randn(8, 512, 256, generator=g) * 0.05)
    experts = {m: CPUExperts(*(get_codec(m, **_codec_params(m, 32, "bytes")).quantize(t) for t in w),
                             gemv_max_tokens=1000) for m in ("int8", "int4")}  # fmt: skip
    decode = (torch.randn(1, 512, generator=g), torch.tensor([[1, 5]]), torch.tensor([[0.75, 0.25]]))
    ids = torch.arange(8).repeat(3).view(12, 2)  # 3 tokens an expert: still the decode regime
    prompt_ids = torch.arange(8).repeat(8).view(32, 2)  # 8 tokens an expert: the prompt regime
    prompt = (torch.randn(32, 512, generator=g), prompt_ids, torch.rand(32, 2, generator=g))
    few = (torch.randn(12, 512, generator=g), ids, torch.rand(12, 2, generator=g))

    try:
        alone = {}
        for bits in (256, 512):
            set_int_vector_bits(bits)
            alone[bits] = {m: [ce.forward(*a) for a in (decode, few, prompt)] for m, ce in experts.items()}
        for m in experts:
            for i in range(3):
                assert not torch.equal(alone[256][m][i], alone[512][m][i]), (m, i)
        set_int_vector_bits(0)
        widths = {"int8": (256, 512), "int4": (512, 256)}  # decode, prompt
        for m, (d, p) in widths.items():
            set_int_vector_bits(d, m, "decode")
            set_int_vector_bits(p, m, "prompt")
        assert int_vector_bits("int8", "decode") == 256 and int_vector_bits("int4", "prompt") == 256
        for m, (d, p) in widths.items():
            got = [experts[m].forward(*a) for a in (decode, few, prompt)]
            assert torch.equal(got[0], alone[d][m][0]) and torch.equal(got[1], alone[d][m][1]), m
            assert torch.equal(got[2], alone[p][m][2]), m
    finally:
        set_int_vector_bits(0)
    with pytest.raises(ValueError, match="family"):
        set_int_vector_bits(512, "int2")
    with pytest.raises(ValueError, match="regime"):
        set_int_vector_bits(512, "int8", "prefill")


def test_bf16_gemv_runs_at_its_familys_width() -> None:
    """The bf16 GEMV on bf16 activations (VDPBF16PS) runs at its own family's width ("bf16") in each
    regime (a linear's job: at most 4 tokens decode, more prompt), apart from the integer families.
    Its 256- and 512-bit loops sum the same exact products in different orders, so the fp32 outputs
    differ, bit for bit, and each is within fp32 summation error of the float64 product."""
    if "avx512" not in ISAS or not engine_module().cpu_features()["avx512_bf16"]:
        pytest.skip("this CPU has no AVX512-BF16")
    from hetmoe.runtime.cpu_linear import _ENGINE_DTYPES, CPULinear

    select_isa("avx512")
    g = torch.Generator().manual_seed(5)
    w = get_codec("bf16").quantize(torch.randn(512, 2048, generator=g) * 0.02)
    lin = CPULinear(w, gemv_max_tokens=1000)
    ref_w = get_codec("bf16").dequantize(w, torch.float32).double()
    xs = [torch.randn(t, 2048, generator=g).bfloat16() for t in (1, 8)]  # decode, prompt

    def run(x: torch.Tensor) -> torch.Tensor:  # fp32 out (the engine's own call), nothing rounded after
        y = torch.empty(x.shape[0], 512)
        lin._engine.forward(x.data_ptr(), _ENGINE_DTYPES[x.dtype], x.shape[0], y.data_ptr(), _ENGINE_DTYPES[y.dtype])
        return y

    try:
        alone = {}
        for bits in (256, 512):
            set_int_vector_bits(bits)
            alone[bits] = [run(x) for x in xs]
            for x, y in zip(xs, alone[bits], strict=True):
                ref = x.double() @ ref_w.T
                # exact products in fp32 sums of 2048 terms: the exact-fp32 paths' bound (their rounding grows
                # as the square root of the terms: ~sqrt(2048) * 2^-24 = 3e-6 relative)
                assert float((y.double() - ref).norm() / ref.norm()) < 1e-5
        for i in range(2):
            assert not torch.equal(alone[256][i], alone[512][i]), i
        set_int_vector_bits(0)
        set_int_vector_bits(512, "int4")
        set_int_vector_bits(512, "int8")  # the integer families' widths do not move bf16's
        for d, p in ((256, 512), (512, 256)):
            set_int_vector_bits(d, "bf16", "decode")
            set_int_vector_bits(p, "bf16", "prompt")
            got = [run(x) for x in xs]
            assert torch.equal(got[0], alone[d][0]) and torch.equal(got[1], alone[p][1]), (d, p)
    finally:
        set_int_vector_bits(0)


def test_default_gemv_switch_follows_the_vector_width() -> None:
    """Where 512-bit GEMVs run every projection, experts and linears stay on them at every token
    count; at 256 bits, or for other formats or widths, the measured switch points hold."""
    from hetmoe.runtime.cpu_experts import GEMV_MAX_INTEGER, default_gemv_max
    from hetmoe.runtime.cpu_linear import CPULinear
    from hetmoe.runtime.engine_layout import GEMV_ALL_TOKENS

    if "avx512" not in ISAS:
        pytest.skip("this CPU has no AVX-512")
    g = torch.Generator().manual_seed(0)
    int4 = [get_codec("int4", group_size=32).quantize(torch.randn(2, 64, k, generator=g)) for k in (512, 512)]
    int8 = [get_codec("int8").quantize(torch.randn(2, 64, 512, generator=g))]
    q5_1 = [get_codec("gguf:q5_1").quantize(torch.randn(2, 64, 512, generator=g))]  # transcoded: its own default
    short = [get_codec("int4", group_size=32).quantize(torch.randn(2, 64, 224, generator=g))]  # no group of 256
    select_isa("avx512")
    try:
        set_int_vector_bits(512)
        assert default_gemv_max(int4) == default_gemv_max(int8) == GEMV_ALL_TOKENS
        assert default_gemv_max(q5_1) == default_gemv_max(short) == GEMV_MAX_INTEGER
        q6_k = [get_codec("gguf:q6_k").quantize(torch.randn(2, 64, 512, generator=g))]
        assert default_gemv_max(q6_k) == GEMV_ALL_TOKENS
        assert CPULinear(torch.randn(64, 512), method="int4").gemv_max_tokens == GEMV_ALL_TOKENS
        assert CPULinear(torch.randn(64, 512), method="bf16").gemv_max_tokens == 4
        set_int_vector_bits(256)
        assert default_gemv_max(int4) == GEMV_MAX_INTEGER
        assert CPULinear(torch.randn(64, 512), method="int4").gemv_max_tokens == 4
    finally:
        set_int_vector_bits(0)


def test_weight_prefetch_hint_changes_no_result() -> None:
    """T0, T1, non-temporal or no weight prefetches, for all GEMV families or one: the same bytes, so
    bit-identical outputs, on fp32 and on bf16 activations (the bf16 GEMV's VDPBF16PS loop where the
    CPU has AVX512-BF16); each family keeps its own hint; the environment and the setter choose, and
    a bad value is a clear error."""
    from hetmoe.kernels.dispatch import PREFETCH_FAMILIES, set_weight_prefetch, weight_prefetches

    g = torch.Generator().manual_seed(0)
    w = [torch.randn(4, 256, 512, generator=g) * 0.05, torch.randn(4, 256, 512, generator=g) * 0.05]
    w.append(torch.randn(4, 512, 256, generator=g) * 0.05)
    x, ids, weights_t = torch.randn(3, 512, generator=g), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2)
    try:
        for method in ("int4", "int8", "bf16"):
            codec = get_codec(method, **({"group_size": 32} if method == "int4" else {}))
            ce = CPUExperts(*(codec.quantize(t) for t in w))
            for xx in (x, x.bfloat16()):
                outs = []
                for hint in ("nta", "t0", "t1", "none"):
                    set_weight_prefetch(hint)
                    assert weight_prefetches() == dict.fromkeys(PREFETCH_FAMILIES, hint)
                    outs.append(ce.forward(xx, ids, weights_t))
                    set_weight_prefetch("t1" if hint == "none" else "none", method)  # its family's alone
                    assert weight_prefetches() == {f: ("t1" if hint == "none" else "none") if f == method else hint
                                                   for f in PREFETCH_FAMILIES}  # fmt: skip
                    outs.append(ce.forward(xx, ids, weights_t))
                assert all(torch.equal(outs[0], o) for o in outs[1:]), (method, xx.dtype)
    finally:
        set_weight_prefetch("default")
    with pytest.raises(ValueError, match="expected one of"):
        set_weight_prefetch("l2")
    with pytest.raises(ValueError, match="family: expected one of"):
        set_weight_prefetch("t0", "fp4")
    code = "from hetmoe.kernels.dispatch import weight_prefetches; print(sorted(set(weight_prefetches().values())))"
    for hint in ("nta", "t0", "t1", "none"):
        env = {**os.environ, "HETMOE_WEIGHT_PREFETCH": hint}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip() == str([hint]), proc
    env = {**os.environ, "HETMOE_WEIGHT_PREFETCH": "always"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1 and "HETMOE_WEIGHT_PREFETCH='always'" in proc.stderr


def test_prefetch_family_of_each_method() -> None:
    """Each stored layout's GEMV takes its family's hint (kernels.h: prefetch_family, from the traits
    row's activation layout): the 4- to 6-bit GEMVs "int4", int8 and Q8_0 "int8", bf16 and fp8 "bf16";
    the codecs stored in another's layout take that one's."""
    from hetmoe.kernels.dispatch import engine_module
    from hetmoe.runtime.engine_layout import prefetch_family

    expected = {"bf16": "bf16", "fp8": "bf16", "int8": "int8", "gguf:q8_0": "int8"}
    for row in engine_module().methods():
        assert prefetch_family(row["name"]) == expected.get(row["name"], "int4"), row["name"]
    assert (prefetch_family("gptq"), prefetch_family("int4-asym"), prefetch_family("fp8-channel")) == (
        "int4",
        "int4",
        "bf16",
    )


def test_int_vector_bits_from_the_environment() -> None:
    code = "from hetmoe.kernels.dispatch import int_vector_bits; print(int_vector_bits())"
    env = {**os.environ, "HETMOE_INT_VECTOR_BITS": "256"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "256", proc
    env["HETMOE_INT_VECTOR_BITS"] = "128"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1 and "HETMOE_INT_VECTOR_BITS='128': expected 256 or 512" in proc.stderr


@pytest.mark.parametrize("isa", ISAS)
def test_f32_to_bf16_rounds_as_torch(isa: str) -> None:
    """The engine's fp32 -> bf16 conversion (the bf16 GEMM path's intermediate) bit for bit as torch's:
    round to nearest even, ties both ways, infinities, NaN kept NaN, subnormals, a ragged tail."""
    select_isa(isa)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-40, 38, 1000).float()
    ties = (torch.arange(64, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)  # exactly halfway
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-45, 3.4e38, -3.4e38])
    src = torch.cat([x, ties, -ties, special]).contiguous()
    dst = torch.empty(src.numel(), dtype=torch.bfloat16)
    engine_module().f32_to_bf16(src.data_ptr(), dst.data_ptr(), src.numel())
    want = src.bfloat16()
    same = (dst.view(torch.int16) == want.view(torch.int16)) | (dst.isnan() & want.isnan())
    assert bool(same.all()), src[~same][:5]


def test_async_submissions_complete_out_of_order(weights) -> None:
    ce = _experts(weights, "int4")
    jobs = []
    for seed in range(6):
        ids, w = _routing(2 + seed * 5, 2, seed)
        x = torch.randn(ids.shape[0], H, generator=torch.Generator().manual_seed(seed))
        jobs.append((ce.submit(x, ids, w), x, ids, w))
    for handle, x, ids, w in reversed(jobs):
        assert _rel(ce.wait(handle), _reference(ce, x, ids, w)) < FP32_BOUND["int4"]


def test_bad_calls_raise_clear_errors(weights) -> None:
    ce = _experts(weights, "int8")
    x = torch.randn(4, H)
    ids, w = _routing(4, 2)
    cases = [
        (lambda: ce.forward(x.half(), ids, w), "x: expected dtype bfloat16 or float32"),
        (lambda: ce.forward(torch.randn(4, H + 1), ids, w), f"x: expected shape [T, {H}]"),
        (lambda: ce.forward(torch.randn(H, 8).T, ids, w), "x: expected a contiguous tensor"),
        (lambda: ce.forward(x, ids.int(), w), "topk_ids: expected int64"),
        (lambda: ce.forward(x, ids[:3], w[:3]), "topk_ids: expected int64 [4, k]"),
        (lambda: ce.forward(x, ids, w.double()), "topk_weights: expected float32"),
        (lambda: ce.forward(x, ids, w[:, :1].contiguous()), "topk_weights: expected float32 [4, 2]"),
        (lambda: ce.forward(x.tolist(), ids, w), "x: expected a torch.Tensor, found list"),
        (lambda: ce.forward(x, ids.to("meta"), w), "topk_ids: expected a CPU tensor, found device meta"),
        (lambda: ce.submit(x, ids, w.T), "topk_weights: expected a contiguous tensor"),
        (lambda: ce.forward(x, ids + E, w), f"topk_ids: expected ids in [-1, {E})"),
        (lambda: ce.forward(x, ids - 5, w), "topk_ids: expected ids in [-1"),
        (lambda: ce.wait(12345), "handle 12345 is not pending"),
        (lambda: ce.set_mask(torch.zeros(E + 1, dtype=torch.bool)), f"mask: expected a bool tensor [{E}]"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    handle = ce.submit(x, ids, w)
    ce.wait(handle)
    with pytest.raises(ValueError, match="not pending"):
        ce.wait(handle)
    # a tensor subclass is not the checks' quick case (forward's explain path runs) and is taken as a tensor
    x_param = torch.nn.Parameter(x, requires_grad=False)
    assert torch.equal(ce.forward(x_param, ids, w), ce.forward(x, ids, w))


def test_bad_construction(weights) -> None:
    g, u, d = weights
    with pytest.raises(ValueError, match="down: expected shape"):
        CPUExperts(g, u, g, "bf16")
    with pytest.raises(ValueError, match="method"):
        CPUExperts(g, u, d, "int3")
    with pytest.raises(ValueError, match="multiple of 32"):
        CPUExperts(torch.randn(2, 8, 48), torch.randn(2, 8, 48), torch.randn(2, 48, 8), "bf16")
    with pytest.raises(ValueError, match="a method the CPU engine runs"):
        CPUExperts(*(QuantizedTensor("nf4", tuple(w.shape), {".weight": w}) for w in weights))
    with pytest.raises(ValueError, match="activation"):
        CPUExperts(g, u, d, "bf16", activation="gelu")
    with pytest.raises(ValueError, match="gate_bias"):
        CPUExperts(g, u, d, "bf16", gate_bias=torch.zeros(E, H))
    with pytest.raises(ValueError, match="group size of 32, 64, 128 or 256"):
        CPUExperts(*(get_codec("int4", group_size=16).quantize(w) for w in weights))


def _run_with_isa(isa: str) -> subprocess.CompletedProcess:
    code = "from hetmoe.kernels.dispatch import engine_module; print(engine_module().selected_isa())"
    env = {**os.environ, "HETMOE_ISA": isa}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


@pytest.mark.parametrize("isa", ["avx2", "avx512", "amx", "sse9"])
def test_forcing_an_isa(isa: str) -> None:
    proc = _run_with_isa(isa)
    if isa in ISAS:
        assert proc.returncode == 0 and proc.stdout.strip() == isa
    else:
        # A clear Python error naming what is missing, never a crash by illegal instruction.
        assert proc.returncode == 1, proc
        assert "ValueError" in proc.stderr and (isa in proc.stderr or "unknown ISA" in proc.stderr)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method", ["bf16", "mxfp4", "int4"])
def test_gpt_oss_activation_with_biases(weights, isa: str, method: str) -> None:
    """gpt-oss's expert MLP: clamped SwiGLU (alpha 1.702, limit 7) with gate/up/down biases."""
    select_isa(isa)
    g = torch.Generator().manual_seed(11)
    # Large enough gate/up values that the clamps are active for some elements.
    scaled = tuple(w * 8 for w in weights)
    biases = {
        "gate_bias": torch.randn(E, I, generator=g),
        "up_bias": torch.randn(E, I, generator=g),
        "down_bias": torch.randn(E, H, generator=g) * 0.1,
    }
    codec = get_codec(method, **_codec_params(method, 32, "bytes"))
    ce = CPUExperts(*(codec.quantize(w) for w in scaled), activation="swiglu-oai", **biases)
    for T, k in ((1, 4), (21, 4)):
        ids, w = _routing(T, k, seed=T)
        x = torch.randn(T, H, generator=g)
        ref = _reference(ce, x, ids, w, activation="swiglu-oai", **biases)
        assert _rel(ce.forward(x, ids, w), ref) < _fp32_bound(method, isa) * 3, (T, k)


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_ragged_blocks(isa: str) -> None:
    """DeepSeek fp8 with N and K not multiples of the 128 block (ragged edge scales)."""
    select_isa(isa)
    g = torch.Generator().manual_seed(5)
    e, h, i = 4, 352, 160
    ws = (
        torch.randn(e, i, h, generator=g) * 0.05,
        torch.randn(e, i, h, generator=g) * 0.05,
        torch.randn(e, h, i, generator=g) * 0.05,
    )
    ce = CPUExperts(*(get_codec("fp8").quantize(w) for w in ws))
    assert ce.gate.tensors[".weight_scale_inv"].shape == (e, 2, 3)
    for T in (1, 17):
        ids = torch.randint(0, e, (T, 2), generator=g)
        x = torch.randn(T, h, generator=g)
        w = torch.rand(T, 2, generator=g)
        assert _rel(ce.forward(x, ids, w), _reference(ce, x, ids, w)) < _fp32_bound("fp8", isa)


def test_gptq_repack_is_reported(weights) -> None:
    ce = _experts(weights, "gptq", 128, "asym,gptq_v2")
    codes = sum(w.numel() // 2 for w in weights)
    assert ce.repacked_bytes >= codes
    assert _experts(weights, "int4").repacked_bytes == 0


@pytest.mark.parametrize(
    "ggml", ["q8_0", "q4_0", "q5_0", "iq4_nl", "q4_k", "q5_k", "q6_k", "iq4_xs", "bf16", "q5_1", "iq2_xxs", "q3_k"]
)
def test_gguf_experts_run_from_their_blocks(ggml: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Q8_0/Q4_0 repack exactly; the other block types are transcoded with the SNR printed; either way
    the output matches the float64 reference built from hetmoe's GGUF decoders (= the gguf package's)."""
    g = torch.Generator().manual_seed(2)
    e, h, i = 4, 512, 256
    ws = (
        torch.randn(e, i, h, generator=g) * 0.05,
        torch.randn(e, i, h, generator=g) * 0.05,
        torch.randn(e, h, i, generator=g) * 0.05,
    )
    codec = get_codec(f"gguf:{ggml}")
    if codec.can_quantize:
        qs = [codec.quantize(w) for w in ws]
    else:  # decode-only types: valid blocks, as a real file holds (random codes, realistic scales)
        qs = [_crafted_blocks(ggml, tuple(w.shape), g) for w in ws]
    ce = CPUExperts(*qs)
    message = capsys.readouterr().err
    native = ggml in ("q8_0", "q4_0", "q5_0", "q4_k", "q5_k", "q6_k", "iq4_xs", "iq4_nl")  # from the stored blocks
    exact = native or ggml == "bf16"
    assert ("SNR" in message) == (not exact)
    assert (ggml.upper() in message) == (not native)
    deq = [codec.dequantize(q) for q in qs]
    ids = torch.randint(0, e, (13, 2), generator=g)
    x = torch.randn(13, h, generator=g)
    w = torch.rand(13, 2, generator=g)
    ref = moe_forward_reference(x, *deq, ids, w)
    if exact:
        bound = 3e-4
    else:
        # Transcoded: the output error follows from the worst projection's transcoding SNR (three
        # projections in series add their errors), which must itself be above 40 dB (int8 target)
        # or 18 dB (int4 target, for sources below 4 bits) to count as equal or better fidelity.
        snr = min(float(note.split("SNR ")[1].split(" dB")[0]) for note in ce.notes)
        assert snr > (18.0 if ggml.startswith(("iq1", "iq2", "iq3", "q2", "q3", "tq")) else 40.0)
        bound = 3 * 10 ** (-snr / 20)
    assert _rel(ce.forward(x, ids, w), ref) < bound


def _crafted_blocks(ggml: str, shape: tuple[int, ...], g: torch.Generator) -> QuantizedTensor:
    from hetmoe.formats.gguf import GGML_TYPES

    info = GGML_TYPES[ggml.upper()]
    nb = shape[-1] // info.block_elements
    raw = torch.randint(0, 256, (*shape[:-1], nb, info.block_bytes), generator=g, dtype=torch.uint8)
    for offset in info.f16_scale_offsets:  # the fp16 super-scales get realistic values, codes stay random
        d = (torch.rand(*shape[:-1], nb, generator=g) * 2e-4 + 1e-4).half().view(torch.uint8)
        raw[..., offset : offset + 2] = d.reshape(*shape[:-1], nb, 2)
    return QuantizedTensor(
        f"gguf:{ggml}", shape, {".weight": raw.reshape(*shape[:-1], -1)}, {"ggml_type": ggml.upper()}
    )


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("down_type", ["gguf:q6_k", "gguf:q5_0"])
def test_gguf_q4_k_m_layer_mixes_types(isa: str, down_type: str) -> None:
    """Q4_K_M: gate/up in Q4_K and down in Q6_K, or in Q5_0 where the expert width is no multiple of
    256 (GLM-4.5-Air's 1408: llama-quantize's fallback), in one layer, all from their stored blocks."""
    select_isa(isa)
    g = torch.Generator().manual_seed(8)
    e, h, i = 4, 512, 256
    gate, up = (get_codec("gguf:q4_k").quantize(torch.randn(e, i, h, generator=g) * 0.05) for _ in range(2))
    down = get_codec(down_type).quantize(torch.randn(e, h, i, generator=g) * 0.05)
    deq = [get_codec(q.method).dequantize(q) for q in (gate, up, down)]
    for gemv_max in (0, 1000):
        ce = CPUExperts(gate, up, down, gemv_max_tokens=gemv_max)
        assert ce.method == "mixed" and ce.repacked_bytes == 0
        for T in (1, 11):
            ids = torch.randint(0, e, (T, 2), generator=g)
            x = torch.randn(T, h, generator=g)
            w = torch.rand(T, 2, generator=g)
            assert _rel(ce.forward(x, ids, w), moe_forward_reference(x, *deq, ids, w)) < 3e-4


@pytest.mark.parametrize(
    "methods",
    [("gguf:q8_0", "gguf:q4_0", "gguf:q4_k"), ("int4", "int8", "gguf:iq4_xs"), ("bf16", "gguf:q4_k", "int4")],
)
def test_gate_and_up_in_different_methods(methods: tuple[str, str, str]) -> None:
    """A GGUF file may store gate and up in two types whose GEMVs read the activations in different
    layouts (Q8_0's int16 codes, Q4_0's digits): each projection must get its own, at either width."""
    g = torch.Generator().manual_seed(9)
    e, h, i = 4, 512, 256
    shapes = ((e, i, h), (e, i, h), (e, h, i))
    qs = [get_codec(m).quantize(torch.randn(s, generator=g) * 0.05) for m, s in zip(methods, shapes, strict=True)]
    deq = [get_codec(q.method, **q.params).dequantize(q) for q in qs]
    widths = (256, 512) if "avx512" in ISAS else (0,)
    try:
        for bits in widths:
            set_int_vector_bits(bits)
            for gemv_max in (0, 1000):
                ce = CPUExperts(*qs, gemv_max_tokens=gemv_max)
                for T in (1, 5):
                    ids = torch.randint(0, e, (T, 2), generator=g)
                    x = torch.randn(T, h, generator=g)
                    w = torch.rand(T, 2, generator=g)
                    ref = moe_forward_reference(x, *deq, ids, w)
                    assert _rel(ce.forward(x, ids, w), ref) < 3e-4, (bits, gemv_max, T)
    finally:
        set_int_vector_bits(0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "methods",
    [(m, m, m) for m in ("int8", "int4", "mxfp4", "fp8", "gguf:q4_0", "gguf:q5_0", "gguf:q8_0", "gguf:iq4_nl")]
    + [(m, m, m) for m in ("gguf:q4_k", "gguf:q5_k", "gguf:q6_k", "gguf:iq4_xs")]
    + [("bf16", "gguf:q4_k", "gguf:q6_k")],
)
def test_bf16_model_gemm_path_every_method(isa: str, methods: tuple[str, str, str]) -> None:
    """A bf16 model's prompt through the GEMM path, every method with a dequantizer (and gate, up and
    down in three): on a CPU with AVX512-BF16 the avx512 variant dequantizes each 24-row panel,
    rounds it to bf16 and runs VDPBF16PS (engine_common.h: bf16_rows); elsewhere the fp32 panel
    GEMM. Against the float64 reference on the stored weights, within BF16_BOUND (the module's
    docstring: four bf16 roundings, ~3.3e-3 RMS); a panel read at a wrong row or stride is ~1."""
    select_isa(isa)
    g = torch.Generator().manual_seed(10)
    e, h, i = 4, 512, 256  # gate/up rows: 10 panels of 24 and 16; down's: 21 and 8 (K = 256: one superblock)
    shapes = ((e, i, h), (e, i, h), (e, h, i))
    qs = [get_codec(m).quantize(torch.randn(s, generator=g) * 0.05) for m, s in zip(methods, shapes, strict=True)]
    deq = [get_codec(q.method, **q.params).dequantize(q) for q in qs]
    ce = CPUExperts(*qs, gemv_max_tokens=0)
    for T in (5, 13):  # 13: a register block of 6 tokens twice and one left
        ids = torch.randint(0, e, (T, 2), generator=g)
        x = torch.randn(T, h, generator=g).bfloat16()
        w = torch.rand(T, 2, generator=g)
        y = ce.forward(x, ids, w)
        assert y.dtype == torch.bfloat16
        assert _rel(y, moe_forward_reference(x.float(), *deq, ids, w)) < BF16_BOUND, T


def test_idle_pool_takes_no_cpu(weights) -> None:
    """Workers sleep once no job runs: an idle engine must not steal cores from the caller."""
    import resource
    import time

    ce = _experts(weights, "int4")
    ids, w = _routing(4, 2)
    ce.forward(torch.randn(4, H), ids, w)
    time.sleep(0.05)  # let the pool settle after the job
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.5)
    after = resource.getrusage(resource.RUSAGE_SELF)
    busy = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert busy < 0.05, f"{busy:.3f} s of CPU while idle"


@pytest.mark.parametrize("method", ["int4", "bf16"])
def test_decode_phase_on_pools_of_several_sizes(weights, method: str) -> None:
    """Where every expert takes the GEMVs, gate/up and down run as one phase, an expert's down items
    waiting on its own gate/up items (MoEJob::fuse). On pools of 1, 2, 3 and 5 threads (the larger
    ones split each expert into several items), with a token routed nowhere and masked experts: the
    reference, and the same bits in every run on a pool (its items split the rows the same way each
    time; a race on the intermediate rows or on the sums would show as a difference between runs)."""
    mod = engine_module()
    before = mod.num_threads()
    ce = _experts(weights, method, gemv_max_tokens=1000)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[2, 5]] = True
    try:
        for threads in (1, 2, 3, 5):
            mod.set_num_threads(threads)
            for T in (1, 3, 6):
                ids, w = _routing(T, 4, seed=T)
                if T == 3:
                    ids[1] = -1
                x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
                for skip in (None, mask):
                    ce.set_mask(skip if skip is not None else torch.zeros(E, dtype=torch.bool))
                    y = ce.forward(x, ids, w)
                    assert _rel(y, _reference(ce, x, ids, w, skip=skip)) < FP32_BOUND[method], (threads, T, skip)
                    assert not torch.count_nonzero(y[(ids < 0).all(1)])  # routed nowhere: zeros
                    for _ in range(20):
                        assert torch.equal(ce.forward(x, ids, w), y), (threads, T, skip)
    finally:
        ce.set_mask(torch.zeros(E, dtype=torch.bool))
        mod.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_pool_sizes_and_replacement_with_jobs_pending(weights, threads: int) -> None:
    """A pool of N is N - 1 workers plus the waiting caller: a pool of one runs every job on the
    waiter, and replacing the pool while jobs are pending finishes them (none is lost or hangs)."""
    mod = engine_module()
    before = mod.num_threads()
    ce = _experts(weights, "int4")
    try:
        mod.set_num_threads(threads)
        jobs = []
        for seed in range(4):
            ids, w = _routing(3 + seed * 7, 2, seed)
            x = torch.randn(ids.shape[0], H, generator=torch.Generator().manual_seed(seed))
            jobs.append((ce.submit(x, ids, w), x, ids, w))
        mod.set_num_threads(2 if threads != 2 else 1)  # the old pool drains on this thread
        for handle, x, ids, w in reversed(jobs):
            assert _rel(ce.wait(handle), _reference(ce, x, ids, w)) < FP32_BOUND["int4"]
        ids, w = _routing(5, 2, 9)
        x = torch.randn(5, H)
        assert _rel(ce.forward(x, ids, w), _reference(ce, x, ids, w)) < FP32_BOUND["int4"]
    finally:
        mod.set_num_threads(before)
