"""router_logits (adapters/routing.py): the router's F.linear from a cached fp32 weight on the CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hetmoe.models.adapters.routing import router_logits


def test_matches_f_linear_in_its_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g).bfloat16()
    w = torch.randn(16, 256, generator=g).bfloat16()
    b = torch.randn(16, generator=g).bfloat16()
    for bias in (None, b):
        expected = F.linear(x, w, bias)
        got = router_logits(x, w, bias)
        assert got.dtype == expected.dtype == torch.bfloat16
        # both accumulate in fp32 and round once: at most one bf16 ulp apart, from the sum's order
        assert bool(((got.float() - expected.float()).abs() <= expected.float().abs() * 2**-7 + 1e-6).all())
    assert type(w._hetmoe_engine[1]).__name__ == "CPULinear"  # a bf16 router runs in the engine
    odd = torch.randn(16, 40, generator=g).bfloat16()  # a width the engine does not run: torch in fp32
    x40 = torch.randn(2, 40, generator=g).bfloat16()
    assert torch.equal(router_logits(x40, odd), F.linear(x40.float(), odd.float()).bfloat16())
    fp32 = router_logits(x, w, fp32=True)  # DeepSeek: fp32 casts of both
    assert fp32.dtype == torch.float32
    torch.testing.assert_close(fp32, F.linear(x.float(), w.float()), rtol=1e-5, atol=1e-5)


def test_a_changed_weight_is_seen_and_grads_flow() -> None:
    w = torch.nn.Parameter(torch.randn(8, 32).bfloat16(), requires_grad=False)
    x = torch.randn(3, 32).bfloat16()
    first = router_logits(x, w)
    with torch.no_grad():
        w.mul_(-1)  # the cached fp32 copy is stale now: its version moved
    torch.testing.assert_close(router_logits(x, w), -first)
    xg = x.float().requires_grad_(True)
    router_logits(xg, w, fp32=True).sum().backward()
    assert xg.grad is not None
