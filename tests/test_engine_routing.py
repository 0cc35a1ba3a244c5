"""The engine's softmax top-k (csrc/routing.h, through models/adapters/routing.py's softmax_topk)
against a float64 reference and torch.topk: the same experts in the same order as torch.topk picks
from transformers' probabilities (ties included), and each weight within the roundings the path
states."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_isas

from hetmoe.models.adapters.routing import softmax_topk


def _reference(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 weights, and the ids torch.topk picks from transformers' fp32 probabilities (equal
    logits, equal probabilities: torch orders those its own way, which the engine follows)."""
    x = logits.double()
    ids = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1).indices
    e = (x - x.max(-1, keepdim=True).values).exp()
    chosen = e.gather(1, ids)
    return chosen / (chosen.sum(-1, keepdim=True) if normalize else e.sum(-1, keepdim=True)), ids


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("experts", "k"), [(8, 2), (64, 6), (128, 8)])
@pytest.mark.parametrize("normalize", [True, False])
def test_engine_softmax_topk_against_float64(dtype: torch.dtype, experts: int, k: int, normalize: bool) -> None:
    gen = torch.Generator().manual_seed(experts + k)
    # bf16 logits of this spread tie often (at the k-th place about one row in six for 128 experts):
    # the ties must go as torch.topk sends them
    logits = (torch.randn(300, experts, generator=gen) * 2).to(dtype)
    want, want_ids = _reference(logits, k, normalize)
    for out_dtype in (None, dtype):
        weights, ids = softmax_topk(logits, k, normalize, out_dtype)
        assert torch.equal(ids, want_ids)
        assert weights.dtype == (out_dtype or torch.float32)
        # exact in float64 (relative error ~1e-16), rounded once to fp32: half an ulp, at most 2^-24
        # of the value (24 significant bits); then, for bf16 out, once more to bf16 (8 bits): 2^-8
        # on top (and their product, 2^-32, the factor 1 + 2^-23 below)
        bound = 2**-24 + (2**-8 if weights.dtype == torch.bfloat16 else 0)
        err = (weights.double() - want).abs() / want
        assert err.max().item() <= bound * (1 + 2**-23), err.max().item()


def test_engine_softmax_topk_keeps_leading_dims_and_falls_back_to_torch_for_autograd() -> None:
    logits = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    weights, ids = softmax_topk(logits, 4, True, None)
    assert weights.shape == ids.shape == (2, 3, 4)
    flat_w, flat_ids = softmax_topk(logits.reshape(6, 16), 4, True, None)
    assert torch.equal(weights.reshape(6, 4), flat_w) and torch.equal(ids.reshape(6, 4), flat_ids)
    # With autograd the weights must carry a graph: torch's ops, not the engine's
    leaf = logits.clone().requires_grad_()
    weights, _ = softmax_topk(leaf, 4, True, None)
    weights.sum().backward()
    assert leaf.grad is not None


# --- the grouped routers (DeepSeek-V2/V3, Kimi-K2, GLM-4.x, MiniMax-M2) ----------------------------


def _grouped_reference(
    logits: torch.Tensor, k: int, *, sigmoid: bool, bias: torch.Tensor | None, groups: int, keep: int,
    by_max: bool, masked_zero: bool, normalize: bool, eps: float, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """float64 weights, and the ids torch.topk(sorted=False) takes from fp32 choice values: the exact
    scores rounded to fp32 plus the bias, in fp32 (as transformers adds them), the groups picked by
    the sum of their two largest values (V3) or their largest (V2)."""
    x = logits.double()
    exact = torch.sigmoid(x) if sigmoid else torch.softmax(x, dim=-1)
    choice = exact.float() + (bias if bias is not None else 0)
    rows, experts = logits.shape
    allowed = torch.ones(rows, experts, dtype=torch.bool)
    if keep < groups:
        grouped = choice.view(rows, groups, experts // groups)
        group_scores = grouped.max(-1).values if by_max else grouped.topk(2, dim=-1).values.sum(-1)
        chosen = torch.topk(group_scores, keep, dim=-1, sorted=False).indices
        in_group = torch.zeros(rows, groups, dtype=torch.bool).scatter_(1, chosen, True)
        allowed = in_group.repeat_interleave(experts // groups, dim=1)
    ids = torch.topk(choice.masked_fill(~allowed, 0.0 if masked_zero else float("-inf")), k, sorted=False).indices
    weights = (exact.masked_fill(~allowed, 0.0) if masked_zero else exact).gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + eps)
    return weights * scaling, ids


# (experts, k, groups, groups kept): DeepSeek-V3/R1 (256 in 8 groups, 4 kept), GLM-4.5-Air (128, one
# group), Kimi-K2 (384, one), DeepSeek-V2-Lite (64), DeepSeek-V2 (160 in 8, 3 kept)
GROUPED = [(256, 8, 8, 4), (128, 8, 1, 1), (384, 8, 1, 1), (64, 6, 1, 1), (160, 6, 8, 3)]


@pytest.mark.parametrize(("experts", "k", "groups", "keep"), GROUPED)
@pytest.mark.parametrize("variant", ["v3_sigmoid", "v3_softmax", "v2", "v2_renormalized"])
def test_engine_grouped_topk_against_float64(experts: int, k: int, groups: int, keep: int, variant: str) -> None:
    from hetmoe.models.adapters.routing import grouped_topk, v2_grouped, v3_grouped

    gen = torch.Generator().manual_seed(experts * 7 + k)
    logits = torch.randn(400, experts, generator=gen) * 2
    # a bias of the spread the checkpoints' e_score_correction_bias has, often larger than the
    # differences between the best scores: it moves the choice away from the weights' order
    bias = torch.rand(experts, generator=gen) * 0.1
    if variant.startswith("v3"):
        sigmoid = variant == "v3_sigmoid"
        spec = dict(sigmoid=sigmoid, bias=bias, by_max=False, masked_zero=False, normalize=True, eps=1e-20)
        weights, ids = grouped_topk(logits, v3_grouped(k, groups, keep, True, 2.5, not sigmoid), bias)
    else:
        renorm = variant == "v2_renormalized"
        spec = dict(sigmoid=False, bias=None, by_max=True, masked_zero=True, normalize=renorm, eps=0.0)
        method = "group_limited_greedy" if keep < groups else "greedy"
        weights, ids = grouped_topk(logits, v2_grouped(k, method, groups, keep, 2.5, renorm))
    want, want_ids = _grouped_reference(logits, k, groups=groups, keep=keep, scaling=2.5, **spec)
    assert torch.equal(ids, want_ids)  # the same experts in the same order
    assert weights.dtype == torch.float32
    # exact in float64 (~1e-15 relative after the exp, the sums and the two products), rounded once
    # to fp32: at most 2^-24 of the value
    err = (weights.double() - want).abs() / want
    assert err.max().item() <= 2**-24 * (1 + 2**-20), err.max().item()


def test_engine_biased_sigmoid_topk_against_float64() -> None:
    """MiniMax-M2's router (one group, renormalised, no eps, bf16 logits taken to fp32)."""
    from hetmoe.models.adapters.routing import GroupedTopk, grouped_topk

    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(300, 256, generator=gen) * 2).to(torch.bfloat16)
    bias = torch.rand(256, generator=gen) * 0.1
    weights, ids = grouped_topk(logits.float(), GroupedTopk(8, normalize=True), bias)  # as its adapter routes
    want, want_ids = _grouped_reference(
        logits.float(), 8, sigmoid=True, bias=bias, groups=1, keep=1, by_max=False, masked_zero=False,
        normalize=True, eps=0.0, scaling=1.0,
    )  # fmt: skip
    assert torch.equal(ids, want_ids)
    assert ((weights.double() - want).abs() / want).max().item() <= 2**-24 * (1 + 2**-20)


def test_engine_grouped_topk_refuses_groups_it_cannot_score() -> None:
    from hetmoe.models.adapters.routing import grouped_topk, v3_grouped

    with pytest.raises(ValueError, match="groups"):
        grouped_topk(torch.randn(2, 8), v3_grouped(2, 8, 4, True, 1.0), torch.zeros(8))


# --- the fp32 router (DeepSeek's, kept in fp32 by transformers) --------------------------------------


@pytest.mark.parametrize("isa", engine_isas())
@pytest.mark.parametrize(("experts", "hidden"), [(64, 2048), (256, 7168), (72, 48)])
def test_engine_fp32_router_against_float64(isa: str, experts: int, hidden: int) -> None:
    """routing.router_logits on an fp32 weight runs csrc/routing.h's router_logits_f32: each logit an
    fp32 FMA chain, within the bound any order of K fp32 products and sums has (gamma_K = K u / (1 - K u),
    u = 2^-24, of the sum of |w x|), and each row's logits the same whatever the number of rows (the
    one-call latent-attention layer computes one)."""
    from hetmoe.kernels.dispatch import select_isa
    from hetmoe.models.adapters.routing import fp32_router_in_engine, router_logits

    select_isa(isa)
    gen = torch.Generator().manual_seed(experts)
    weight = torch.randn(experts, hidden, generator=gen) * 0.02
    x = torch.randn(5, hidden, generator=gen).to(torch.bfloat16)
    assert fp32_router_in_engine(weight, None)
    with torch.no_grad():
        got = router_logits(x, weight, fp32=True)
        one = router_logits(x[2:3], weight, fp32=True)
    assert got.dtype == torch.float32 and got.shape == (5, experts)
    assert torch.equal(one[0], got[2])
    exact = x.double() @ weight.double().T
    u = 2**-24
    gamma = hidden * u / (1 - hidden * u)
    scale = x.double().abs() @ weight.double().abs().T
    assert ((got.double() - exact).abs() <= gamma * scale).all()


def test_fp32_router_leaves_widths_and_autograd_to_torch() -> None:
    from hetmoe.models.adapters.routing import fp32_router_in_engine, router_logits

    assert not fp32_router_in_engine(torch.randn(8, 40), None)  # not whole 16s
    assert not fp32_router_in_engine(torch.randn(8, 64), torch.zeros(8))  # a bias
    assert not fp32_router_in_engine(torch.randn(8, 64).bfloat16(), None)  # the bf16 engine linear's
    weight = torch.randn(8, 64, requires_grad=True)
    router_logits(torch.randn(3, 64), weight, fp32=True).sum().backward()
    assert weight.grad is not None
