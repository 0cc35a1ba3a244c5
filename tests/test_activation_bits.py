"""HETMOE_ACTIVATION_BITS=8: the 4- to 6-bit GEMVs on int8-level activations, the explicit
lower-accuracy choice (kernels.h: g_act_one_digit), against float64 references.

Bounds (relative L2 error):
- against the float64 product with the activations quantized as llama.cpp's Q8 blocks are (per 32:
  d = amax / 127, q = round(x / d), computed here in fp32 as the engine does): 1e-5, fp32 arithmetic
  only (the bound the fp32 paths have in test_engine.py; measured 1e-7 to 3e-7);
- against the exact product: 1e-2. Each activation is off by at most half a step, amax / 254, evenly
  spread: an RMS of amax / (254 sqrt 3), and a block of 32 normal values has amax under 4 sigma:
  4 / 440 = 9.1e-3 relative (measured 4.3e-3 to 5.9e-3). Experts quantize twice (x, then the
  intermediate): sqrt 2 times that, 1.3e-2, held to 1.5e-2.
"""

import os
import subprocess
import sys

import pytest
import torch
from conftest import engine_isas

from hetmoe.formats import get_codec
from hetmoe.kernels import moe_forward_reference, select_isa
from hetmoe.kernels.dispatch import activation_bits, set_activation_bits, set_int_vector_bits
from hetmoe.runtime import CPUExperts
from hetmoe.runtime.cpu_linear import CPULinear

ISAS = engine_isas(("avx2", "avx512"))
# (method, K): whole 512-bit groups, and a row whose last blocks take the 256-bit loop (K % 256 = 32)
LOW_BIT = [
    ("int4", 640),
    ("int4", 544),
    ("mxfp4", 640),
    ("gguf:q4_0", 640),
    ("gguf:q4_0", 544),
    ("gguf:iq4_nl", 544),
    ("gguf:q5_0", 544),
    ("gguf:q4_k", 768),
    ("gguf:q5_k", 768),
    ("gguf:q6_k", 768),
    ("gguf:iq4_xs", 768),
]
pytestmark = pytest.mark.usefixtures("keep_isa")


@pytest.fixture(autouse=True)
def _restore_bits():
    yield
    set_activation_bits(16)
    set_int_vector_bits(0)


def _codec(method: str):
    return get_codec(method, **({"group_size": 32} if method == "int4" else {}))


def _q8(x: torch.Tensor) -> torch.Tensor:
    """x as the engine's one-digit codes hold it, in float64: per block of 32, round(x * (127 / amax))
    in fp32 (half to even), times 256 * (amax / 32512) (the block's scale, fp32)."""
    xb = x.float().reshape(-1, 32)
    amax = xb.abs().amax(1, keepdim=True)
    q = torch.round(xb * (torch.tensor(127.0) / amax))
    return (q.double() * 256 * (amax / 32512.0).double()).reshape(x.shape)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method,k", LOW_BIT)
def test_int8_activations_are_q8_blocks(isa: str, method: str, k: int) -> None:
    select_isa(isa)
    g = torch.Generator().manual_seed(k)
    codec = _codec(method)
    q = codec.quantize(torch.randn(96, k, generator=g) * 0.05)
    w = codec.dequantize(q).double()
    lin = CPULinear(q)
    x = torch.randn(3, k, generator=g)
    exact, q8 = x.double() @ w.T, _q8(x) @ w.T
    with torch.no_grad():
        set_activation_bits(16)
        err16 = _rel(lin(x[:1]), exact[:1])
        set_activation_bits(8)
        for width in (512, 256) if isa != "avx2" else (256,):  # the one-digit and the two-digit loops
            set_int_vector_bits(width)
            for t in (1, 3):  # one token, and a GEMV pass of three
                y = lin(x[:t])
                assert _rel(y, q8[:t]) < 1e-5, (width, t)
                assert _rel(y, exact[:t]) < 1e-2, (width, t)
                assert _rel(y, exact[:t]) > 20 * err16  # int8 activations, not int16 ones


@pytest.mark.parametrize("isa", ISAS)
def test_int8_activations_leave_the_other_gemvs(isa: str) -> None:
    """int8, Q8_0, bf16 and fp8 GEMVs take the same activations whatever the setting."""
    select_isa(isa)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 512, generator=g)
    for method in ("int8", "gguf:q8_0", "bf16", "fp8"):
        lin = CPULinear(get_codec(method).quantize(torch.randn(64, 512, generator=g) * 0.05))
        with torch.no_grad():
            set_activation_bits(16)
            y16 = lin(x)
            set_activation_bits(8)
            assert torch.equal(lin(x), y16), method


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("method", ["int4", "gguf:q4_k"])
def test_int8_activations_in_experts(isa: str, method: str) -> None:
    """Experts on the GEMV path, the intermediate quantized again: within sqrt 2 of one quantization."""
    select_isa(isa)
    g = torch.Generator().manual_seed(2)
    codec = _codec(method)
    e, h, i = 8, 512, 256
    gate, up = (codec.quantize(torch.randn(e, i, h, generator=g) * 0.05) for _ in range(2))
    down = codec.quantize(torch.randn(e, h, i, generator=g) * 0.05)
    ce = CPUExperts(gate, up, down)
    x, ids, w = torch.randn(3, h, generator=g), torch.tensor([[0, 1], [2, 3], [1, 7]]), torch.rand(3, 2)
    deq = [codec.dequantize(p).float() for p in (gate, up, down)]
    ref = moe_forward_reference(x.double(), *(p.double() for p in deq), ids, w.double())
    set_activation_bits(8)
    assert _rel(ce.forward(x, ids, w), ref) < 1.5e-2
    set_activation_bits(16)
    assert _rel(ce.forward(x, ids, w), ref) < 3e-4  # test_engine.py's int16-level bound


def test_activation_bits_setting() -> None:
    assert activation_bits() == 16  # the default
    set_activation_bits(8)
    assert activation_bits() == 8
    with pytest.raises(ValueError, match="expected 8 or 16"):
        set_activation_bits(4)
    code = "from hetmoe.kernels.dispatch import activation_bits; print(activation_bits())"
    for bits in ("8", "16"):
        env = {**os.environ, "HETMOE_ACTIVATION_BITS": bits}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0 and proc.stdout.strip() == bits, proc
    env = {**os.environ, "HETMOE_ACTIVATION_BITS": "12"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 1 and "HETMOE_ACTIVATION_BITS='12'" in proc.stderr


def test_a_model_loaded_with_int8_activations_says_so(tiny_cache) -> None:
    """The choice is named among the load's notes (hetmoe generate -v, summary(), the benchmarks' records)."""
    from hetmoe import load_model

    path = tiny_cache.model("qwen3_moe")
    note = "4- to 6-bit GEMVs on int8 activations (HETMOE_ACTIVATION_BITS=8)"
    assert note not in load_model(path).hetmoe.notes
    set_activation_bits(8)
    assert note in load_model(path).hetmoe.notes
