"""Qwen3-Next's one-token gated delta rule in the engine (models/delta_rule.py, csrc/delta_rule.h)
against transformers' torch_recurrent_gated_delta_rule and a float64 evaluation of the same rule.

The engine forms the same fp32 products as torch and sums them in another order, so the two agree
to fp32 summation rounding, not bit for bit. Bound: each output is two chained dot products of
length dk through the state (the memory read, then the query read), each within dk * 2^-24 of
exact relative to the sum of its terms' magnitudes (the standard dot-product error bound), plus a
few ulps from exp and the l2 norms' square root; with dk <= 64 and the random, well-conditioned
data here, 1e-5 of the largest output (and state entry) bounds both implementations against
float64, and so their difference to 2e-5.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _original():
    rule = modeling.torch_recurrent_gated_delta_rule
    return getattr(rule, "hetmoe_original", rule)


def _inputs(k_heads: int, v_heads: int, dk: int, dv: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, k_heads, dk, generator=gen).to(dtype)
    k = torch.randn(1, 1, k_heads, dk, generator=gen).to(dtype)
    v = torch.randn(1, 1, v_heads, dv, generator=gen).to(dtype)
    g = -torch.rand(1, 1, v_heads, generator=gen)  # log decay <= 0, as -exp(A_log) * softplus(.) is
    beta = torch.rand(1, 1, v_heads, generator=gen).to(dtype)
    state = torch.randn(1, v_heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def _float64(q, k, v, g, beta, state):
    """The rule as transformers writes it, every step in float64."""
    r = v.shape[2] // q.shape[2]
    q, k = (x.double().repeat_interleave(r, dim=2)[0, 0] for x in (q, k))
    v, g, beta, s = v.double()[0, 0], g.double()[0, 0], beta.double()[0, 0], state.double()[0].clone()
    q = q / q.norm(dim=-1, keepdim=True) / q.shape[-1] ** 0.5
    k = k / k.norm(dim=-1, keepdim=True)
    s = s * g.exp()[:, None, None]
    delta = (v - torch.einsum("hkv,hk->hv", s, k)) * beta[:, None]
    s = s + k[:, :, None] * delta[:, None, :]
    return torch.einsum("hkv,hk->hv", s, q), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("k_heads", "v_heads", "dk", "dv"), [(2, 4, 16, 16), (4, 4, 64, 32), (2, 8, 32, 64)])
def test_engine_step_equals_transformers_rule(k_heads: int, v_heads: int, dk: int, dv: int, dtype) -> None:
    from hetmoe.models.delta_rule import _step

    q, k, v, g, beta, state = _inputs(k_heads, v_heads, dk, dv, dtype, seed=dk + dv)
    want_out, want_state = _original()(q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)  # fmt: skip
    ref_out, ref_state = _float64(q, k, v, g, beta, state)
    engine_state = state.clone()
    out, new_state = _step(q, k, v, g, beta, engine_state, output_final_state=True)
    assert new_state is engine_state  # updated in place
    assert out.dtype == want_out.dtype == dtype and out.shape == want_out.shape
    scale_out, scale_state = float(ref_out.abs().max()), float(ref_state.abs().max())
    assert float((new_state[0].double() - ref_state).abs().max()) <= 1e-5 * scale_state
    assert float((want_state[0].double() - ref_state).abs().max()) <= 1e-5 * scale_state
    if dtype == torch.float32:
        assert float((out[0, 0].double() - ref_out).abs().max()) <= 1e-5 * scale_out
        assert float((want_out[0, 0].double() - ref_out).abs().max()) <= 1e-5 * scale_out
    else:  # both round the same fp32 outputs (within the bound above) to bf16: at most one bf16 ulp apart
        diff = (out.float() - want_out.float()).abs()
        assert bool((diff <= want_out.float().abs() * 2**-7 + 1e-30).all())


def test_qwen3next_decode_takes_the_engine_step(tmp_path, monkeypatch) -> None:
    """A Qwen3-Next loaded on the CPU runs its linear-attention layers' decode steps in the engine (a
    prompt still takes transformers' chunked rule), and 8 greedy steps give logits within the bound
    above (carried through the model: 1e-4 of the largest logit) of the same model with the flag off;
    a transformers model of the same weights, not flagged, keeps transformers' arithmetic."""
    from tiny_models import build_tiny, greedy_logits
    from transformers import AutoModelForCausalLM

    import hetmoe.models.delta_rule as delta_rule
    from hetmoe import load_model

    path = build_tiny("qwen3_next", tmp_path / "next", dtype=torch.float32)
    model = load_model(path, dtype=torch.float32)
    assert sum(getattr(vars(m).get("forward"), "hetmoe_delta_rule", False) for m in model.modules()) == 1
    steps: list[bool] = []
    real = delta_rule._step

    def spy(*args):
        steps.append(True)
        return real(*args)

    monkeypatch.setattr(delta_rule, "_step", spy)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        fast = greedy_logits(model, ids, 8)
    assert len(steps) == 8  # the one linear-attention layer, every decode step
    steps.clear()
    with monkeypatch.context() as m:
        m.setattr(delta_rule, "_applies", lambda *a: False)
        with torch.inference_mode():
            slow = greedy_logits(model, ids, 8)
    assert not steps
    for a, b in zip(fast, slow, strict=True):
        assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max())
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        greedy_logits(reference, ids, 2)
    assert not steps
