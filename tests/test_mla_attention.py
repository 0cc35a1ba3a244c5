"""The absorbed MLA attention (models/mla_attention.py) against transformers' own DeepseekV2/V3
attention modules, in fp32, on prefill and decode, with and without q_lora, with YaRN.

The reference is the module's unmodified forward (expanding the latent cache through kv_b_proj).
The absorbed form does the same products in another association order, so in fp32 the two differ
by summation rounding only: a few ulps of the products' magnitude over sums of ~kv_lora_rank terms,
bounded here at 1e-5 relative (fp32's 2^-24 ~ 6e-8 per operation, times the ~10^2 terms summed)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import rel
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from hetmoe.models import mla_attention
from hetmoe.models.adapters import get_adapter
from hetmoe.models.mla_attention import install_mla
from hetmoe.runtime.kv_cache import growing_cache

EXACT = 1e-5  # fp32 both ways, products reassociated (module docstring)


def _config(arch: str, q_lora: int | None, heads: int, rank: int, rope: int, yarn: bool) -> object:
    common = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=2560,
    )
    if yarn:  # DeepSeek-V3's and Kimi-K2's rope_scaling, shrunk: mscale enters the attention's scaling
        common["rope_scaling"] = {
            "type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    config = DeepseekV3Config(**common, rope_interleave=True) if arch == "deepseek_v3" else DeepseekV2Config(**common)
    config._attn_implementation = "eager"  # the reference: transformers' eager attention, masks explicit
    return config


def _modules(arch: str, config: object):
    mod = v3 if arch == "deepseek_v3" else v2
    cls = mod.DeepseekV3Attention if arch == "deepseek_v3" else mod.DeepseekV2Attention
    rotary = (mod.DeepseekV3RotaryEmbedding if arch == "deepseek_v3" else mod.DeepseekV2RotaryEmbedding)(config)
    torch.manual_seed(0)
    attn = cls(config, layer_idx=0).eval()
    for p in attn.parameters():  # transformers leaves Linear weights to _init_weights; norms at one
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
        else:
            p.data.uniform_(0.5, 1.5)
    return attn, rotary


def _run(attn, rotary, x: torch.Tensor, cache, start: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One forward; a boolean mask is given to transformers' eager attention (which adds its mask) as
    the additive mask its own mask builder makes."""
    if mask is not None and mask.dtype == torch.bool and not getattr(attn.forward, "hetmoe_mla", False):
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    t = x.shape[1]
    pos = torch.arange(start, start + t).unsqueeze(0).expand(x.shape[0], t)
    with torch.no_grad():
        out, _ = attn(
            hidden_states=x, position_embeddings=rotary(x, pos), attention_mask=mask, cache=cache, position_ids=pos
        )
    return out


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("q_lora", [None, 48])
@pytest.mark.parametrize(
    ("heads", "rank", "rope", "yarn"),
    [
        (8, 32, 16, True),  # the engine's kernels, decode heads in 8 groups
        (4, 32, 16, False),  # the engine's kernels, decode heads in 4 groups
        (4, 24, 8, False),  # widths the kernel does not take: the same arithmetic in torch
    ],
)
@pytest.mark.parametrize("cache_kind", ["dynamic", "growing"])
@pytest.mark.parametrize("prompt_form", ["absorbed", "expanded"])
def test_absorbed_equals_transformers(
    arch: str,
    q_lora: int | None,
    heads: int,
    rank: int,
    rope: int,
    yarn: bool,
    cache_kind: str,
    prompt_form: str,
    monkeypatch,
) -> None:
    if prompt_form == "expanded":  # the 9- and 5-token prompts take the long-prompt form
        monkeypatch.setattr(mla_attention, "_EXPANDED_MIN_TOKENS", 2)
    kernel_calls = []
    for kernel in ("_engine_prefill", "_engine_decode", "_expanded_prompt"):
        real = getattr(mla_attention, kernel)
        spy = lambda *a, real=real, kernel=kernel: kernel_calls.append(kernel) or real(*a)  # noqa: E731
        monkeypatch.setattr(mla_attention, kernel, spy)
    config = _config(arch, q_lora, heads, rank, rope, yarn)
    reference, rotary = _modules(arch, config)
    ours = copy.deepcopy(reference)
    assert install_mla(ours, get_adapter(config)) == 1
    make = DynamicCache if cache_kind == "dynamic" else growing_cache
    ref_cache, our_cache = DynamicCache(config=config), make(config=config)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randn(1, 9, 64, generator=g)
    causal = torch.ones(1, 1, 9, 9, dtype=torch.bool).tril()
    want = _run(reference, rotary, prompt, ref_cache, 0, causal)
    got = _run(ours, rotary, prompt, our_cache, 0)  # no mask: causal, as SDPA's is_causal
    assert rel(got, want) <= EXACT
    for step in range(4):  # decode, one token at a time
        x = torch.randn(1, 1, 64, generator=g)
        want = _run(reference, rotary, x, ref_cache, 9 + step)
        got = _run(ours, rotary, x, our_cache, 9 + step)
        assert rel(got, want) <= EXACT, step
    # the cache holds only the latent rows: (kv_lora_rank + qk_rope_head_dim) per token and layer
    layer = our_cache.layers[0]
    assert tuple(layer.keys.shape) == (1, 1, 13, rank + rope) and layer.values.shape[-1] == 0
    # a second chunk of prompt continuing the cache (causal against the cached rows)
    x = torch.randn(1, 5, 64, generator=g)
    full_mask = torch.ones(1, 1, 5, 18, dtype=torch.bool).tril(13)
    want = _run(reference, rotary, x, ref_cache, 13, full_mask)
    got = _run(ours, rotary, x, our_cache, 13, full_mask)
    assert rel(got, want) <= EXACT
    # the engine's kernels ran every call whose widths they take: prompt, 4 decode steps, prompt (the
    # expanded form only where its per-head widths are multiples of 16 too: here exactly then)
    prompt = ["_expanded_prompt", "_engine_prefill"] if prompt_form == "expanded" else ["_engine_prefill"]
    if rank % 16 == 0 and rope % 16 == 0:
        assert kernel_calls == [*prompt, *["_engine_decode"] * 4, *prompt]
    else:
        assert not kernel_calls


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_padded_batch_equals_transformers(arch: str) -> None:
    """Two sequences, the first left-padded by 3: the boolean mask reaches the kernel as an additive one."""
    config = _config(arch, 48, 8, 32, 16, False)
    reference, rotary = _modules(arch, config)
    ours = copy.deepcopy(reference)
    install_mla(ours, get_adapter(config))
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    mask[0, :, :, :3] = False
    mask[0, :, :3, :3] = torch.eye(3, dtype=torch.bool)  # padded rows see themselves (no all-masked row)
    want = _run(reference, rotary, x, DynamicCache(config=config), 0, mask)
    got = _run(ours, rotary, x, DynamicCache(config=config), 0, mask)
    assert rel(got, want) <= EXACT


def test_autograd_and_training_take_transformers_forward() -> None:
    config = _config("deepseek_v3", 48, 8, 32, 16, False)
    reference, rotary = _modules("deepseek_v3", config)
    ours = copy.deepcopy(reference)
    install_mla(ours, get_adapter(config))
    x = torch.randn(1, 6, 64, requires_grad=True)
    pos = torch.arange(6).unsqueeze(0)
    out, _ = ours(hidden_states=x, position_embeddings=rotary(x, pos), attention_mask=None)
    out.sum().backward()  # transformers' forward: differentiable, no cache involved
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_bf16_absorbed_within_bf16_rounding(monkeypatch) -> None:
    """bf16 model: both paths round their products to bf16 (2^-9 relative each) at different points,
    transformers at the expanded K/V, this path at the latent query and output (its one-token steps
    keep them fp32, in the engine's bf16-weight GEMVs): a few of those roundings, propagated through
    softmax and two products, bounded at 2e-2, and no worse than transformers' own bf16 path."""
    gemvs = []
    real = mla_attention._head_gemv
    monkeypatch.setattr(mla_attention, "_head_gemv", lambda *a: gemvs.append(1) or real(*a))
    config = _config("deepseek_v3", 48, 8, 32, 16, False)
    reference, rotary = _modules("deepseek_v3", config)
    reference = reference.to(torch.bfloat16)
    ours = copy.deepcopy(reference)
    install_mla(ours, get_adapter(config))
    exact = copy.deepcopy(reference).float()
    g = torch.Generator().manual_seed(3)
    caches = [DynamicCache(config=config) for _ in range(3)]
    for step, t in enumerate((12, 1, 1, 1)):
        x = torch.randn(1, t, 64, generator=g).to(torch.bfloat16)
        start = 0 if step == 0 else 11 + step
        causal = torch.ones(1, 1, t, start + t, dtype=torch.bool).tril(start)
        want = _run(exact, rotary, x.float(), caches[0], start, causal)
        got = _run(ours, rotary, x, caches[1], start)  # no mask: causal over the cache
        ref = _run(reference, rotary, x, caches[2], start, causal)
        assert rel(got, want) <= 2e-2, step
        assert rel(got, want) <= 1.5 * rel(ref, want), step
    assert len(gemvs) == 6  # each one-token step: W_UK^T and W_UV products in the engine's GEMV


# --- whole models through load_model ------------------------------------------------------------


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("q_lora", [None, 32])
def test_model_greedy_decode_equals_transformers(arch: str, q_lora: int | None, tmp_path, one_torch_thread) -> None:
    """A tiny DeepSeek model with widths the engine's kernel takes (latent 32 + rope 16, 8 heads), fp32:
    hetmoe's CPU load (absorbed MLA, engine experts in bf16 as stored, exact in fp32) generates the
    same 32 greedy tokens as transformers' own fp32 model; logits within 1e-5 (fp32 reassociation)."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    from hetmoe import load_model

    config = tiny_config(
        arch,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        q_lora_rank=q_lora,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path)
    want_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ours = load_model(tmp_path, dtype=torch.float32)
    assert sum(getattr(m.forward, "hetmoe_mla", False) for m in ours.modules()) == config.num_hidden_layers
    paths = ours.hetmoe.summary(verbose=True)  # names the path each layer takes
    assert paths.count("MLA absorbed") == 2 and "routed experts in the engine (bf16)" in paths  # layer 0 dense
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=32, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = want_model.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):
        assert rel(a, b) <= EXACT
    layer = got.past_key_values.layers[0]  # the cache hetmoe's model filled holds latent rows only
    assert layer.keys.shape[-1] == 32 + 16 and layer.values.shape[-1] == 0
