"""The fused CPU rotary embedding against transformers' own apply_rotary_pos_emb, bit for bit."""

from __future__ import annotations

import importlib

import pytest
import torch

from hetmoe.models.fused_rope import FAMILIES, _fused


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("batch", "cos_batch", "tokens"), [(1, 1, 1), (2, 2, 7), (3, 1, 5)])
def test_bit_identical_to_transformers(
    family: str, dtype: torch.dtype, batch: int, cos_batch: int, tokens: int
) -> None:
    module = importlib.import_module(family)
    original = getattr(module.apply_rotary_pos_emb, "hetmoe_original", module.apply_rotary_pos_emb)
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, dim = 4, 2, 16
    # q and k as attention makes them: [B, T, H, D] projections viewed as [B, H, T, D]
    q = (torch.randn(batch, tokens, heads, dim, generator=g) * 3).to(dtype).transpose(1, 2)
    k = (torch.randn(batch, tokens, kv_heads, dim, generator=g) * 3).to(dtype).transpose(1, 2)
    angles = torch.rand(cos_batch, tokens, dim, generator=g) * 20
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    with torch.no_grad():
        expected = original(q, k, cos, sin)
        got = _fused(original)(q, k, cos, sin)
    for e, o in zip(expected, got, strict=True):
        assert o.shape == e.shape and o.dtype == e.dtype
        assert torch.equal(o, e)


def test_falls_back_where_it_does_not_apply() -> None:
    module = importlib.import_module(FAMILIES[0])
    original = getattr(module.apply_rotary_pos_emb, "hetmoe_original", module.apply_rotary_pos_emb)
    calls = []

    def spy(*args):
        calls.append(1)
        return original(*args)

    fused = _fused(spy)
    q = torch.randn(1, 2, 3, 8, requires_grad=True)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    fused(q, q, cos, sin)  # autograd: the original
    fused(q.detach().half(), q.detach().half(), cos.half(), sin.half())  # fp16: the original
    qt = q.detach().transpose(1, 2)  # [B, T, H, D]
    fused(qt, qt, cos, sin, 2)  # another unsqueeze_dim: the original
    assert len(calls) == 3
    with torch.no_grad():
        fused(q, q, cos, sin)
    assert len(calls) == 3
