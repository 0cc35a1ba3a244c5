"""The engine's SiLU (csrc/decode_step.h: silu_rounded, through runtime/engine_activations.py's EngineSiLU),
which the MLPs on the engine use so that a one-call decode layer and a module's forward agree: its
values against float64, and torch's silu wherever autograd needs a graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import engine_isas

from hetmoe.runtime.engine_activations import EngineSiLU

# The engine computes g * (1 / (1 + exp(-g))) in fp32 with a polynomial exp good to ~1 ulp
# (kernels_common.inc: vexp, 2^-23 relative) and three roundings (the add, the division, the product:
# 2^-24 each); the relative errors add up to 5 * 2^-24 at most (and their products, ~2^-46, below the
# slack of the factor). bf16 output: one more rounding, 2^-8 of the value.
FP32_BOUND = 5 * 2**-24 * (1 + 2**-20)


@pytest.mark.parametrize("isa", engine_isas())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_activations_against_float64(isa: str, dtype: torch.dtype) -> None:
    from hetmoe.kernels.dispatch import select_isa

    select_isa(isa)
    gen = torch.Generator().manual_seed(3)
    # the MLPs' range (a sweep over [-30, 30]) and a random spread; odd lengths reach the scalar tail
    x = torch.cat([torch.linspace(-30, 30, 6001), torch.randn(4099, generator=gen) * 4]).to(dtype)
    with torch.no_grad():
        got = EngineSiLU()(x.view(1, -1)).view(-1)
    assert got.dtype == dtype and got.shape == x.shape
    want = F.silu(x.double())
    bound = FP32_BOUND + (2**-8 if dtype == torch.bfloat16 else 0)
    err = (got.double() - want).abs() / want.abs().clamp_min(1e-30)
    assert err.max().item() <= bound, err.max().item()


def test_engine_activations_leaves_autograd_to_torch() -> None:
    x = torch.randn(3, 40, requires_grad=True)
    y = EngineSiLU()(x)
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(y.detach(), F.silu(x.detach()))


# sigmoid as 1 / (1 + expf(-x)) in fp32: libm's expf within an ulp (2^-23 relative), then the add
# and the division, 2^-24 each (the add's error shrinks by exp(-x) / (1 + exp(-x)) < 1 on the way):
# 4 * 2^-24 at most; bf16 output one rounding more, 2^-8.
SIGMOID_BOUND = 4 * 2**-24 * (1 + 2**-20)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_sigmoid_against_float64(dtype: torch.dtype) -> None:
    from hetmoe.runtime.engine_activations import engine_sigmoid

    gen = torch.Generator().manual_seed(4)
    x = torch.cat([torch.linspace(-30, 30, 6001), torch.randn(999, generator=gen) * 4]).to(dtype)
    with torch.no_grad():
        got = engine_sigmoid(x.view(7, -1)).view(-1)
    assert got.dtype == dtype
    want = torch.sigmoid(x.double())
    bound = SIGMOID_BOUND + (2**-8 if dtype == torch.bfloat16 else 0)
    err = (got.double() - want).abs() / want
    assert err.max().item() <= bound, err.max().item()
    grad = torch.randn(5, requires_grad=True)
    engine_sigmoid(grad).sum().backward()  # autograd: torch's sigmoid
    assert grad.grad is not None
