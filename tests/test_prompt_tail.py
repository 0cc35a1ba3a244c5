"""A prompt's last MLP for the kept rows only (models/prompt_tail.py), against the same model's full
forward and transformers' own generate."""

from __future__ import annotations

import inspect

import pytest
import torch

from hetmoe.runtime.kv_cache import growing_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# MoE families whose last layer's MLP differs in kind: plain routed experts (Qwen3-MoE, Mixtral),
# shared experts and MLA (DeepSeek-V3, GLM-4-MoE), a (output, router scores) tuple (gpt-oss).
FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe", "mixtral")


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict:
    from tiny_models import build_tiny

    root = tmp_path_factory.mktemp("prompt_tail")
    return {arch: build_tiny(arch, root / arch) for arch in FAMILIES}


def _prompt(length: int = 9) -> torch.Tensor:
    return torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", FAMILIES)
def test_kept_rows_match_the_full_forward_and_the_cache_is_the_same(tiny_dirs, tmp_path, arch: str) -> None:
    """With logits_to_keep=3 the last layer's experts see 3 rows (the routing record counts them) while
    every other layer sees all 9; the kept logits match the full forward's last 3 rows, and every
    layer's cache is bit-identical (attention runs on every row in both).

    Bound: the kept rows go through the same modules with the same weights; only the engine's expert
    kernels may sum a batch of 3 rows in another order than one of 9 (fp32 partial sums), so the
    logits agree to fp32 rounding: 1e-5 of the largest logit."""
    from hetmoe import load_model

    model = load_model(tiny_dirs[arch], dtype=torch.float32, record_routing=tmp_path / "routing.json")
    assert model._hetmoe_prompt_tail
    assert "logits_to_keep" in inspect.signature(model.forward).parameters  # generate still passes it
    stats = model.hetmoe.stats
    ids = _prompt()
    with torch.inference_mode():
        kept_cache, full_cache = growing_cache(model.config), growing_cache(model.config)
        kept = model(ids, cache=kept_cache, use_cache=True, logits_to_keep=3).logits
        tail_tokens = dict(stats.routed_tokens)
        full = model(ids, cache=full_cache, use_cache=True).logits
    moe_layers = sorted(tail_tokens)
    assert tail_tokens[moe_layers[-1]] == 3
    assert all(tail_tokens[layer] == 9 for layer in moe_layers[:-1])
    assert kept.shape[1] == 3
    scale = float(full.abs().max())
    assert float((kept - full[:, -3:]).abs().max()) <= 1e-5 * scale
    for a, b in zip(kept_cache.layers, full_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_anything_that_reads_every_row_turns_it_off(tiny_dirs, tmp_path) -> None:
    """Hidden states asked for, training mode, logits_to_keep 0 or a tensor of positions: the last
    layer's experts see every row (the routing record counts 9)."""
    from hetmoe import load_model

    model = load_model(tiny_dirs["qwen3_moe"], dtype=torch.float32, record_routing=tmp_path / "routing.json")
    stats = model.hetmoe.stats
    last = model.config.num_hidden_layers - 1
    ids = _prompt()
    calls = [
        {"logits_to_keep": 0},
        {"logits_to_keep": torch.tensor([8])},
        {"logits_to_keep": 1, "output_hidden_states": True},
    ]
    with torch.inference_mode():
        for kwargs in calls:
            before = stats.routed_tokens.get(last, 0)
            model(ids, cache=growing_cache(model.config), use_cache=True, **kwargs)
            assert stats.routed_tokens[last] - before == 9, kwargs
        before = stats.routed_tokens[last]
        model.train()
        try:
            model(ids, cache=growing_cache(model.config), use_cache=True, logits_to_keep=1)
        finally:
            model.eval()
        assert stats.routed_tokens[last] - before == 9


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_generate_takes_it_and_matches_transformers(tiny_dirs, tmp_path, arch: str) -> None:
    """transformers' generate (greedy, 16 new tokens) through hetmoe's model, whose prompt forward now
    runs the last layer's experts on one row, gives the tokens transformers' own fp32 model gives on
    the same weights; the routing record shows the prompt's last layer saw one row."""
    from transformers import AutoModelForCausalLM

    from hetmoe import load_model

    model = load_model(tiny_dirs[arch], dtype=torch.float32, record_routing=tmp_path / "routing.json")
    reference = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
    ids = _prompt()
    settings = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        ours = model.generate(ids, cache=growing_cache(model.config), **settings)
        theirs = reference.generate(ids, **settings)
    assert torch.equal(ours, theirs)
    last = model.config.num_hidden_layers - 1
    # the prompt's row, then one per generated token but the last (generate stops after sampling it)
    assert model.hetmoe.stats.routed_tokens[last] == 1 + 15
