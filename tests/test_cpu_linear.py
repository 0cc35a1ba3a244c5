"""CPULinear (a dense y = x W^T + b in the CPU engine) against pure torch on the same stored bytes,
and load_model(dense_method=...) against the plain load.

Bounds (relative L2 error against ``x @ dequantize(W).T + b`` in float64), the engine's own per-method
bounds of tests/test_engine.py: fp32 activations 1e-5 for bf16/fp8 weights (fp32 math) and 3e-4 for
the integer formats, whose GEMV path quantizes activations to int16 per block of 32; bf16 activations
and output 5e-3 (one bf16 rounding is at most 3.9e-3 relative, ~1.6e-3 RMS; where the CPU has
AVX512-BF16 the GEMM path also rounds the dequantized weights to bf16: two roundings, ~2.3e-3 RMS).
"""

import math

import pytest
import torch
from conftest import TILE_GEMM_BOUND, TILE_ISAS, engine_isas

from hetmoe.formats import QuantizedTensor, get_codec, snr_db
from hetmoe.kernels import select_isa
from hetmoe.kernels.dispatch import engine_module, selected_isa
from hetmoe.runtime.cpu_linear import _ENGINE_DTYPES, CPULinear
from hetmoe.runtime.fused_linears import FusedSlice

N, K = 200, 640  # N is not a multiple of the 24-row panels (tails exercised); K a multiple of 128
FP32_BOUND = {"bf16": 1e-5, "fp8": 1e-5, "fp8-channel": 1e-5}
INT_BOUND = 3e-4
BF16_BOUND = 5e-3
METHODS = ("bf16", "int8", "int4", "int4-asym", "gptq", "mxfp4", "fp8", "fp8-channel", "gguf:q4_0", "gguf:q8_0")
TOKENS = (1, 3, 7, 64, 300)


def _isas() -> list[str]:
    return engine_isas()


pytestmark = pytest.mark.usefixtures("keep_isa")


@pytest.fixture(scope="module")
def weight() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(N, K, generator=g) * 0.05, torch.randn(N, generator=g)


def _params(method: str) -> dict:
    return {"group_size": 64} if method in ("int4", "int4-asym", "gptq") else {}


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("method", METHODS)
def test_matches_dequantized_reference(weight, method: str, isa: str) -> None:
    select_isa(isa)
    w, b = weight
    q = get_codec(method, **_params(method)).quantize(w)
    deq = get_codec(method, **_params(method)).dequantize(q, torch.float32).double()  # pure torch, same bytes
    lin = CPULinear(q, b)
    plain = CPULinear(q)
    assert lin.isa == isa and (lin.in_features, lin.out_features, lin.method) == (K, N, method)
    bound = FP32_BOUND.get(method, INT_BOUND)
    if isa in TILE_ISAS:  # the GEMM path (the larger token counts) on tiles: one split GEMM
        bound = max(bound, TILE_GEMM_BOUND)
    gen = torch.Generator().manual_seed(1)
    for t in TOKENS:
        x = torch.randn(t, K, generator=gen)
        ref = x.double() @ deq.T
        assert _rel(plain(x), ref) < bound, (t, "no bias")
        y = lin(x)
        assert y.dtype == torch.float32 and y.shape == (t, N)
        assert _rel(y, ref + b.double()) < bound, t
        xb = x.bfloat16()
        yb = lin(xb)
        assert yb.dtype == torch.bfloat16
        assert _rel(yb, xb.double() @ deq.T + b.double()) < BF16_BOUND, (t, "bf16")


# Rows long enough that a 1-token GEMV on fp32 activations streams four rows a pass (x's fp32 row
# fills half of L1d: K >= 4096 on 32 KiB, 6144 on 48 KiB, 8192 on 64 KiB; kernels_common.inc:
# gemv_bf16_t), and a row count that leaves a tail of one-row passes.
LONG_N, LONG_K = 39, 8192 + 128


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("method", ["bf16", "fp8"])
def test_long_rows_four_at_a_time_sum_as_one_row(method: str, isa: str) -> None:
    """One token takes the four-row pass, two tokens the one-row pass: each row's sums run in the
    same order in both, so the first token's outputs are equal bit for bit, and within the fp32
    bound of the float64 reference on the same stored bytes."""
    select_isa(isa)
    g = torch.Generator().manual_seed(2)
    w = torch.randn(LONG_N, LONG_K, generator=g) * 0.02
    q = get_codec(method).quantize(w)
    deq = get_codec(method).dequantize(q, torch.float32).double()
    lin = CPULinear(q, gemv_max_tokens=4)
    x = torch.randn(2, LONG_K, generator=g)
    one, two = lin(x[:1]), lin(x)
    assert torch.equal(one[0], two[0])
    assert _rel(one, x[:1].double() @ deq.T) < FP32_BOUND[method]


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("k", [2048 + 32, LONG_K])
def test_bf16_rows_on_bf16_activations(k: int, isa: str) -> None:
    """A bf16 model's GEMV: bf16 weights on bf16 activations, fp32 out. Where the CPU has AVX512-BF16,
    the AVX-512 units multiply the bf16 pairs themselves (VDPBF16PS, kernels.h Act::h): each product
    of two bf16 values is exact in fp32, so the sums keep the fp32 bound (1e-5) of the float64
    reference; 1 to 4 tokens sum each row in the same order (the first token's outputs equal bit for
    bit, whether one token takes four rows a pass or not); K = 2080 leaves a last 32 past the loop's
    64 a step. There the outputs differ in some bit from the fp32 loop's on the same values (the
    sums run in another order): the bf16 path ran."""
    select_isa(isa)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(LONG_N, k, generator=g) * 0.02
    q = get_codec("bf16").quantize(w)
    deq = get_codec("bf16").dequantize(q, torch.float32).double()
    lin = CPULinear(q, gemv_max_tokens=4)
    x = torch.randn(4, k, generator=g).bfloat16()

    def run(x: torch.Tensor) -> torch.Tensor:  # fp32 out, whatever x's dtype (the engine's own call)
        y = torch.empty(x.shape[0], LONG_N)
        lin._engine.forward(x.data_ptr(), _ENGINE_DTYPES[x.dtype], x.shape[0], y.data_ptr(), _ENGINE_DTYPES[y.dtype])
        return y

    outs = [run(x[:t]) for t in (1, 2, 3, 4)]
    for y in outs:
        assert torch.equal(y[0], outs[0][0])
    ref = x.double() @ deq.T
    assert _rel(outs[-1], ref) < FP32_BOUND["bf16"]
    if isa != "avx2" and engine_module().cpu_features()["avx512_bf16"]:
        assert not torch.equal(outs[-1], run(x.float()))


def _int8_gemm_bound() -> float:
    """int8 rows on the GEMM path: fp32 math on dequantized panels, or on AMX int8 tiles against
    activations as int16 codes per token (the GEMVs' accuracy; they quantize per block of 32)."""
    return INT_BOUND if selected_isa() in TILE_ISAS else 1e-5


def test_gemv_and_gemm_paths_agree_and_leading_dims(weight) -> None:
    """7 tokens through the GEMV path (two groups of <= 4) and the GEMM path give the same answer;
    x [2, 5, K] keeps its leading dims; fp16 is computed in fp32; zero tokens give an empty result."""
    w, b = weight
    q = get_codec("int8").quantize(w)
    gemv, gemm = CPULinear(q, b, gemv_max_tokens=8), CPULinear(q, b, gemv_max_tokens=0)
    x = torch.randn(7, K, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ gemv.dequantized().double().T + b.double()
    assert _rel(gemv(x), ref) < INT_BOUND and _rel(gemm(x), ref) < _int8_gemm_bound()
    x3 = x[:6].reshape(2, 3, K)
    assert torch.equal(gemm(x3), gemm(x[:6]).reshape(2, 3, N))
    y16 = gemm(x.half())
    assert y16.dtype == torch.float16 and _rel(y16, ref) < 2e-3
    assert gemm(torch.empty(0, K)).shape == (0, N)


def test_few_rows_split_the_tokens_too() -> None:
    """30 output rows make one work item; the prefill (the GEMM path here) then splits its tokens
    across the workers."""
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(30, K, generator=g) * 0.05, torch.randn(30, generator=g)
    lin = CPULinear(w, b, "int8", gemv_max_tokens=0)
    for t in (5, 64, 301):
        x = torch.randn(t, K, generator=g)
        assert _rel(lin(x), x.double() @ lin.dequantized().double().T + b.double()) < _int8_gemm_bound(), t


def test_float_weight_is_quantized_and_async_matches(weight) -> None:
    w, b = weight
    lin = CPULinear(w, b, "int4", group_size=32)
    expected = get_codec("int4", group_size=32).quantize(w)
    assert torch.equal(lin.weight_q.tensors[".weight"], expected.tensors[".weight"])
    assert lin.nbytes == expected.nbytes + 4 * N
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3))
    handle = lin.submit(x)
    assert torch.equal(lin.wait(handle), lin(x))
    with pytest.raises(ValueError, match="not pending"):
        lin.wait(handle)


def test_bad_calls_are_value_errors(weight) -> None:
    w, b = weight
    lin = CPULinear(w, b, "int8")
    with pytest.raises(ValueError, match=rf"x: expected shape \[\.\.\., {K}\], found \[3, 64\]"):
        lin(torch.zeros(3, 64))
    with pytest.raises(ValueError, match="x: expected dtype"):
        lin(torch.zeros(3, K, dtype=torch.int32))
    with pytest.raises(ValueError, match="expected a CPU tensor"):
        lin(torch.zeros(3, K, device="meta"))
    with pytest.raises(ValueError, match=r"x: expected a torch\.Tensor"):
        lin([[0.0] * K])
    with pytest.raises(ValueError, match="inference-only"):
        lin(torch.zeros(3, K, requires_grad=True))
    with pytest.raises(ValueError, match=r"bias: expected a tensor \[200\]"):
        CPULinear(w, torch.zeros(N + 1), "int8")
    with pytest.raises(ValueError, match="2-D weight"):
        CPULinear(w.unsqueeze(0), None, "int8")
    with pytest.raises(ValueError, match="method"):
        CPULinear(w, None, "int3")
    with pytest.raises(ValueError, match="in method 'int4'"):
        CPULinear(get_codec("int8").quantize(w), None, "int4")
    with pytest.raises(ValueError, match="multiple of 32"):
        CPULinear(torch.randn(8, 48), None, "bf16")
    q = get_codec("int8").quantize(w)
    broken = QuantizedTensor("int8", q.shape, {".weight": q.tensors[".weight"]}, q.params)  # no scales
    with pytest.raises(ValueError, match="weight_scale"):
        CPULinear(broken)


# --- load_model(dense_method=...) -------------------------------------------------------------


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def test_load_model_dense_int8_close_to_bf16_and_generates(tiny_cache) -> None:
    """int8 dense layers: every non-expert Linear but the router becomes a CPULinear, and the logits
    stay within a bound derived from the codec's SNR: each quantized Linear adds a relative error
    of about 10^(-SNR/20) to its output; about nine of them lie on a token's path (q, k, v, o and
    the shared/dense MLPs per layer, the lm_head), adding up to sqrt(9) = 3 times that when
    independent, so 4 times it is the bound (measured: ~1.5 times)."""
    from hetmoe import load_model

    path = tiny_cache.model("qwen3_moe")
    ref = load_model(path, dense_method="torch")
    model = load_model(path, dense_method="int8")
    # q/k/v run fused (fused_linears.py): each stands as a FusedSlice of one CPULinear
    linears = {n: m for n, m in model.named_modules() if isinstance(m, CPULinear | FusedSlice)}
    linears = {n: m for n, m in linears.items() if not n.endswith("fused_qkv_proj.linear")}
    expected = {n for n, m in ref.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(linears) == expected and "lm_head" in linears
    assert isinstance(linears["model.layers.0.self_attn.k_proj"], FusedSlice)
    assert all(m.method == "int8" for m in linears.values())
    ref_modules = dict(ref.named_modules())
    snr = min(snr_db(ref_modules[n].weight.float(), m.dequantized()) for n, m in linears.items())
    assert 30 < snr < 60  # int8 per-row scales on these weights: the codec is doing its job
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    expected_logits = _logits(ref, ids)
    err = _rel(_logits(model, ids), expected_logits.double())
    assert err < 4 * 10 ** (-snr / 20), (err, snr)
    # bf16 in the engine computes what torch's bf16 Linear does, up to output rounding.
    assert _rel(_logits(load_model(path, dense_method="bf16"), ids), expected_logits.double()) < BF16_BOUND
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 16)


def test_load_model_dense_keeps_what_the_engine_cannot_run(tiny_cache) -> None:
    """Qwen2-MoE: the shared expert's down_proj (input 48) stays in torch and is named in the notes;
    the router and the shared-expert gate are never converted."""
    from hetmoe import load_model

    model = load_model(tiny_cache.model("qwen2_moe"), dense_method="int4", dense_group_size=32)
    kinds = {
        n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear | CPULinear | FusedSlice)
    }
    assert kinds["model.layers.0.mlp.shared_expert.down_proj"] == "Linear"
    assert kinds["model.layers.0.mlp.shared_expert_gate"] == "Linear"
    assert kinds["model.layers.0.self_attn.q_proj"] == "FusedSlice"  # of q/k/v's one CPULinear
    assert kinds["model.layers.0.self_attn.o_proj"] == "CPULinear"
    assert any("in_features 48 is not a multiple of 32" in n for n in model.hetmoe.notes)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    assert math.isfinite(float(_logits(model, ids).sum()))
    with pytest.raises(ValueError, match="dense_method"):
        load_model(tiny_cache.model("qwen2_moe"), dense_method="int3")
    with pytest.raises(ValueError, match="needs device='cpu'"):
        load_model(tiny_cache.model("qwen2_moe"), device="meta", dense_method="int8")
