"""The engine's softmax top-k (csrc/routing.h, through models/adapters/routing.py's softmax_topk)
against a float64 reference and torch.topk: the same experts in the same order as torch.topk picks
from transformers' probabilities (ties included), and each weight within the roundings the path
states."""

from __future__ import annotations

import pytest
import torch

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
