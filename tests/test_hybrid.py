"""The hybrid runtime against transformers' own models: routing, logits, placement, generation, memory.

What is compared, precisely (``rel(a, b) = max|a - b| / max|b|`` over all logits):

- routing: each adapter's routing function against the transformers router module of the same
  block on the same input: the same ids and bit-identical weights; where the routing is softmax
  top-k, which the engine computes (csrc/routing.h), the same ids and the weights within the two
  paths' roundings (test_routing_matches_transformers_router).
- bf16 experts, fp32 models: ``load_model(path, method="bf16", dtype=float32)`` against
  ``AutoModelForCausalLM.from_pretrained(path, dtype=float32)``. Both run the checkpoint's bf16
  expert weights exactly (bf16 -> fp32 is exact); the CPU engine accumulates in fp32 in another
  order, so the bound is 1e-5 (measured: about 3e-7).
- bf16 experts, bf16 models: here transformers rounds to bf16 after every projection and the
  engine only once at the end, so neither is "the" answer: hetmoe's distance to the fp32
  reference must be at most transformers' own bf16 distance x 1.25 plus one bf16 ulp (2^-8).
- int8 / int4: fp32 models, hetmoe's quantized experts against transformers' bf16 experts. With
  each projection quantized at a relative error eps = 10^(-SNR/20) (SNR: the worst expert's, from
  the codec), an expert's output moves by at most about eps_gate + eps_up + eps_down = 3 eps to
  first order; the MoE output is a convex-ish combination of experts and a part of the residual
  stream, so rel(logits) <= 3 eps (measured: at most 0.92 eps, DeepSeek-V3 int4).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from conftest import devices
from tiny_models import MODEL_TYPES, logits, rel, tokens
from transformers import AutoModelForCausalLM

from hetmoe import load_model
from hetmoe.checkpoint import open_source
from hetmoe.checkpoint.config import read_config
from hetmoe.checkpoint.experts import codec_of, read_layer_experts
from hetmoe.checkpoint.layout import moe_layout
from hetmoe.formats import snr_db
from hetmoe.models.adapters import get_adapter
from hetmoe.runtime.cpu_linear import CPULinear
from hetmoe.runtime.placement import choose_swaps, plan_placement
from hetmoe.runtime.torch_experts import TorchCPUExperts

FUSABLE = tuple(m for m in MODEL_TYPES if m != "gpt_oss")  # gpt-oss is only ever fused
LAYOUTS = [(m, None) for m in MODEL_TYPES] + [(m, True) for m in FUSABLE]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def tiny(tiny_cache, tmp_path_factory):
    """``tiny(model_type, fused=None)``: a tiny checkpoint transformers itself can run.

    tiny_models writes DeepSeek-V3's config with head_dim=16 while its rotary dimension is
    qk_rope_head_dim=8, and transformers' DeepSeek-V3 then fails in attention; a copy with
    head_dim = qk_rope_head_dim (the value DeepseekV3Config derives itself) is used instead.
    """
    fixed: dict[tuple[str, bool | None], Path] = {}
    root = tmp_path_factory.mktemp("tiny-fixed")

    def get(model_type: str, fused: bool | None = None) -> Path:
        src = tiny_cache.model(model_type, fused)
        config = json.loads((src / "config.json").read_text())
        rope = config.get("qk_rope_head_dim")
        if rope is None or config.get("head_dim") == rope:
            return src
        key = (model_type, fused)
        if key not in fixed:
            dst = tiny_cache.copy(src, root / f"{model_type}-{fused}")
            config["head_dim"] = rope
            (dst / "config.json").write_text(json.dumps(config, indent=2))
            fixed[key] = dst
        return fixed[key]

    return get


def reference(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


# --- routing ------------------------------------------------------------------------------------


def _router_variants(model_type: str) -> list[dict]:
    """Config overrides that take the router down its other branches."""
    return {
        "qwen3_moe": [{"norm_topk_prob": True}],
        "qwen2_moe": [{"norm_topk_prob": True}],
        "olmoe": [{"norm_topk_prob": True}],
        "deepseek_v2": [{"topk_method": "group_limited_greedy"}],
        "deepseek_v3": [{"n_group": 4, "topk_group": 2, "norm_topk_prob": False}],
    }.get(model_type, [])


# Routers the engine computes on the CPU (csrc/routing.h, through routing.py: softmax_topk,
# topk_softmax, the grouped and the biased sigmoid routers): every one so far
ENGINE_ROUTED = {"qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3",
                 "glm4_moe", "minimax_m2"}  # fmt: skip


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_routing_matches_transformers_router(model_type: str) -> None:
    from tiny_models import tiny_config

    for overrides in [{}, *_router_variants(model_type)]:
        config = tiny_config(model_type, **overrides)
        torch.manual_seed(3)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        adapter = get_adapter(config)
        block = next(m for m in model.modules() if adapter.is_moe_block(m))
        with torch.no_grad():
            for name, buf in block.named_buffers():
                if "e_score_correction_bias" in name:  # zero after init: make it matter
                    buf.copy_(torch.rand(buf.shape) * 0.1)
            router = getattr(block, adapter.router_attr)
            x = torch.randn(33, config.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
            args = (block.e_score_correction_bias,) if model_type == "minimax_m2" else ()
            _, want_w, want_ids = router(x, *args)
            got_w, got_ids = adapter.route(block, x)
        assert got_w.dtype == want_w.dtype and torch.equal(got_ids, want_ids), (model_type, overrides)
        if model_type not in ENGINE_ROUTED:
            assert torch.equal(got_w, want_w), (model_type, overrides)
            continue
        # Each weight is within a few fp32 ulps of exact on both sides (the engine: one rounding;
        # torch: its vectorised exp or sigmoid, the multiply by 1 / sum or the renormalising division,
        # the scaling, each within an ulp or two): 2^-20 apart at most. Rounded to bf16, two such values are at most
        # one bf16 step apart: 2^-7 of the value.
        bound = 2**-7 if want_w.dtype == torch.bfloat16 else 2**-20
        assert ((got_w.float() - want_w.float()).abs() <= bound * want_w.float().abs()).all(), (model_type, overrides)


# --- logits -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model_type", "fused"), LAYOUTS)
def test_bf16_experts_match_transformers(model_type: str, fused: bool | None, tiny) -> None:
    path = tiny(model_type, fused)
    ids = tokens()
    want32 = logits(reference(path, torch.float32), ids)
    model = load_model(path, method="bf16", device="cpu", dtype=torch.float32)
    assert not [n for n, _ in model.named_parameters() if ".experts." in n]  # never allocated
    assert rel(logits(model, ids), want32) <= 1e-5

    theirs16 = rel(logits(reference(path, torch.bfloat16), ids), want32)
    ours16 = rel(logits(load_model(path, method="bf16"), ids), want32)
    assert ours16 <= 1.25 * theirs16 + 2**-8, (ours16, theirs16)


def _worst_snr(path: Path, method: str) -> float:
    source = open_source(path)
    layout = moe_layout(read_config(path), source)
    worst = math.inf
    for layer in layout.moe_layers:
        full = read_layer_experts(source, layout, layer)
        quant = read_layer_experts(source, layout, layer, method)
        for proj, q in quant.projections.items():
            w = codec_of(full.projections[proj]).dequantize(full.projections[proj])
            w_hat = codec_of(q).dequantize(q)
            worst = min(worst, *(snr_db(w[e], w_hat[e]) for e in range(w.shape[0])))
    return worst


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_quantized_experts_within_snr_bound(model_type: str, method: str, tiny) -> None:
    path = tiny(model_type)
    ids = tokens()
    want = logits(reference(path, torch.float32), ids)
    got = logits(load_model(path, method=method, dtype=torch.float32), ids)
    eps = 10 ** (-_worst_snr(path, method) / 20)
    assert rel(got, want) <= 3 * eps, (rel(got, want), eps)


@pytest.mark.parametrize("method", ["gguf:q8_0", "gguf:q4_0", "gguf:q5_0", "gguf:iq4_nl"])
def test_gguf_block_types_as_load_methods(method: str, tiny) -> None:
    """load_model quantizes experts to a GGUF block type layer by layer (the engine's native kernels)."""
    path = tiny("qwen3_moe")
    ids = tokens()
    want = logits(reference(path, torch.float32), ids)
    got = logits(load_model(path, method=method, dtype=torch.float32), ids)
    eps = 10 ** (-_worst_snr(path, method) / 20)
    assert rel(got, want) <= 3 * eps, (rel(got, want), eps)


def test_gguf_types_hetmoe_cannot_quantize_or_block_are_clear_errors(tiny) -> None:
    path = tiny("qwen3_moe")
    with pytest.raises(ValueError, match="gguf:q2_k"):
        load_model(path, method="gguf:q2_k")
    with pytest.raises(ValueError, match="divisible by 256"):  # K-quant super-blocks need K % 256 == 0
        load_model(path, method="gguf:q4_k")


def test_stored_quantized_checkpoints_run_as_stored(tiny_cache, tmp_path: Path) -> None:
    """Kimi-K2 int4 (compressed-tensors, model_type kimi_k2 through the V3 adapter), DeepSeek fp8 and
    gpt-oss mxfp4 run in their stored precision; the torch fallback, which dequantizes exactly,
    agrees (to 1e-4: the engine's integer kernels quantize activations to int16 blocks, ~1e-5)."""
    cases = {"int4": tiny_cache.int4(), "fp8": tiny_cache.fp8(), "mxfp4": tiny_cache.mxfp4()}
    for method, src in cases.items():
        path = tiny_cache.copy(src, tmp_path / method)
        config = json.loads((path / "config.json").read_text())
        if "qk_rope_head_dim" in config:
            config["head_dim"] = config["qk_rope_head_dim"]  # see the tiny fixture
            (path / "config.json").write_text(json.dumps(config))
        ids = tokens()
        engine = load_model(path, dtype=torch.float32)
        assert next(iter(engine.hetmoe.layers.values())).cpu.gate.method == method
        fallback = load_model(path, dtype=torch.float32, expert_backend="torch")
        assert isinstance(next(iter(fallback.hetmoe.layers.values())).cpu, TorchCPUExperts)
        assert rel(logits(engine, ids), logits(fallback, ids)) <= 1e-4, method


def test_fp8_non_expert_weights_are_dequantized(tiny, tmp_path: Path) -> None:
    """DeepSeek-V3's release stores attention projections in fp8 with block scales too; they load
    as their dequantized values (compared with a checkpoint holding exactly those values in fp32)."""
    from tiny_models import load_state, read_json, write_checkpoint

    from hetmoe.formats import get_codec

    src = tiny("qwen3_moe")
    state = load_state(src)
    codec = get_codec("fp8", block_size=(32, 32))
    fp8_state, exact_state = dict(state), dict(state)
    for key in [k for k in state if ".self_attn." in k and k.endswith("_proj.weight")]:
        q = codec.quantize(state[key].float(), key)
        del fp8_state[key]
        fp8_state.update(q.state_dict(key.removesuffix(".weight")))
        exact_state[key] = codec.dequantize(q)
    config = read_json(src / "config.json")
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [32, 32],
        "modules_to_not_convert": ["*.mlp.experts"],
    }
    fp8 = write_checkpoint(src, tmp_path / "fp8", fp8_state, config)
    exact = write_checkpoint(src, tmp_path / "exact", exact_state)
    ids = tokens()
    got = logits(load_model(fp8, dtype=torch.float32, dense_method="torch"), ids)
    want = logits(load_model(exact, dtype=torch.float32, dense_method="torch"), ids)
    assert torch.equal(got, want)
    # By default (as stored) the fp8 projections run in the engine in fp8 with their block scales
    stored = load_model(fp8, dtype=torch.float32)
    attn = stored.model.layers[0].self_attn
    assert {m.method for m in attn.modules() if isinstance(m, CPULinear)} == {"fp8"}
    assert rel(logits(stored, ids), want) <= 1e-5  # fp8 decoded exactly, fp32 sums reassociated


def test_gpt_oss_torch_fallback_is_exact(tiny) -> None:
    """The gpt-oss fallback (biases, clamped SwiGLU in torch) against transformers, fp32 and bf16."""
    path = tiny("gpt_oss")
    ids = tokens()
    want32 = logits(reference(path, torch.float32), ids)
    model = load_model(path, method="bf16", dtype=torch.float32, expert_backend="torch")
    assert any("fallback" in n for n in model.hetmoe.notes)
    assert rel(logits(model, ids), want32) <= 1e-5
    # In bf16 the fallback does transformers' own operations in transformers' order.
    want16 = logits(reference(path, torch.bfloat16), ids)
    assert rel(logits(load_model(path, method="bf16", expert_backend="torch"), ids), want16) <= 2**-7


# --- the device / CPU split ---------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_device_experts_split_computes_each_pair_once(model_type: str, device: str, tiny, tmp_path: Path) -> None:
    """fp32 throughout: bf16 experts are exact in fp32 on both paths, so only the order of sums differs
    between the engine and the device's matmuls (1e-5; cuda's fp32 matmuls are full fp32, TF32 being
    off by default)."""
    path = tiny(model_type)
    ids = tokens(1)
    all_cpu = logits(load_model(path, method="bf16", dtype=torch.float32), ids)
    stats = tmp_path / "routing.json"
    model = load_model(path, method="bf16", dtype=torch.float32, gpu_experts=3, record_routing=stats, device=device)
    got = logits(model, ids)
    assert rel(got, all_cpu) <= 1e-5
    runtime = model.hetmoe
    runtime.save_routing_stats()
    routed = json.loads(stats.read_text())["layers"]
    for layer, hybrid in runtime.layers.items():
        on_device = torch.zeros(8, dtype=torch.bool)
        on_device[hybrid.device_ids] = True
        assert on_device.sum() == 3
        dev, cpu = hybrid.device_experts.counts.cpu(), hybrid.cpu_counts.cpu()
        assert not dev[~on_device].any() and not cpu[on_device].any()
        assert (dev + cpu).tolist() == routed[str(layer)]["counts"]
        assert sum(routed[str(layer)]["counts"]) == ids.numel() * 2  # top-2 of every token


# --- placement ----------------------------------------------------------------------------------


def test_placement_strategies() -> None:
    layers = [1, 2, 3, 4]
    assert plan_placement("uniform", layers, 8, per_layer=2) == {layer: [0, 1] for layer in layers}
    plan = plan_placement("uniform", layers, 8, total=6)
    assert [len(v) for v in plan.values()] == [2, 2, 1, 1]
    front = plan_placement("front-loading", layers, 8, total=10)
    sizes = [len(v) for v in front.values()]
    assert sum(sizes) == 10 and sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    assert [len(v) for v in plan_placement("front-loading", layers, 3, total=12).values()] == [3, 3, 3, 3]
    r1 = plan_placement("random", layers, 8, per_layer=3, seed=7)
    assert r1 == plan_placement("random", layers, 8, per_layer=3, seed=7)
    assert r1 != plan_placement("random", layers, 8, per_layer=3, seed=8)
    assert all(len(set(v)) == 3 for v in r1.values())
    freq = {layer: torch.tensor([1.0, 9, 2, 8, 0, 0, 0, 0]) for layer in layers}
    freq[4] = torch.tensor([100.0, 0, 0, 0, 0, 0, 0, 0])  # one very concentrated layer
    assert plan_placement("frequency", layers, 8, per_layer=2, frequencies=freq)[1] == [1, 3]
    glob = plan_placement("frequency", layers, 8, total=4, frequencies=freq)
    assert glob[4] == [0] and sum(len(v) for v in glob.values()) == 4
    with pytest.raises(ValueError, match="routing statistics"):
        plan_placement("frequency", layers, 8, per_layer=1)
    with pytest.raises(ValueError, match="unknown placement"):
        plan_placement("hottest", layers, 8, per_layer=1)


def test_recorded_routing_drives_frequency_placement(tiny, tmp_path: Path) -> None:
    path = tiny("qwen3_moe")
    stats = tmp_path / "stats.json"
    model = load_model(path, record_routing=stats)
    logits(model, tokens(2, (4, 16)))
    model.hetmoe.save_routing_stats()
    counts = {int(k): v["counts"] for k, v in json.loads(stats.read_text())["layers"].items()}
    placed = load_model(path, gpu_experts=2, placement="frequency", routing_stats=stats).hetmoe.placement
    for layer, c in counts.items():
        top2 = sorted(range(8), key=lambda e: (-c[e], e))[:2]
        assert placed[layer] == sorted(top2)
    with pytest.raises(ValueError, match="routing-statistics"):
        load_model(path, gpu_experts=2, placement="frequency", routing_stats=path / "config.json")


def test_choose_swaps_has_hysteresis() -> None:
    counts = torch.tensor([10.0, 11, 0, 50, 12, 0, 0, 0])
    assert choose_swaps(counts, [0, 1], margin=0.25) == [(0, 3)]  # 12 is not 25% above 11
    assert choose_swaps(counts, [3, 4], margin=0.25) == []


@pytest.mark.parametrize("device", devices())
def test_dynamic_replacement_moves_hot_experts_to_device(device: str, tiny) -> None:
    """A skewed routing trace (experts 5 and 6 take most tokens): after a few calls they are the
    device experts, and the layer's output is still the all-CPU output."""
    path = tiny("qwen3_moe")
    model = load_model(path, dtype=torch.float32, gpu_experts=2, replace_every=2, device=device)
    reference_model = load_model(path, dtype=torch.float32)
    layer = 1
    hybrid, plain = model.hetmoe.layers[layer], reference_model.hetmoe.layers[layer]
    assert hybrid.device_ids == [0, 1]
    gen = torch.Generator().manual_seed(5)

    def skewed(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        hot = torch.tensor([5, 6]).repeat(t, 1)
        cold = torch.randint(0, 8, (t, 2), generator=gen)
        ids = torch.where(torch.rand(t, 1, generator=gen) < 0.8, hot, cold)
        ids[:, 1] = torch.where(ids[:, 0] == ids[:, 1], (ids[:, 1] + 1) % 8, ids[:, 1])
        return torch.full((t, 2), 0.5, device=x.device), ids.to(x.device)

    for h in (hybrid, plain):
        h.adapter = type(h.adapter)(h.adapter.config)
        h.adapter.route = skewed
    for step in range(6):
        x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(step))
        state = gen.get_state()
        got = hybrid(x.to(device))
        got = (got[0] if isinstance(got, tuple) else got).cpu()
        gen.set_state(state)  # the same trace for the all-CPU layer
        want = plain(x)
        assert rel(got, want) <= 1e-5
    assert hybrid.device_ids == [5, 6] and hybrid.replacements == 2


# --- generation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_greedy_generation_matches_transformers(model_type: str, tiny) -> None:
    """32 greedy tokens equal transformers' in bf16. Where bf16 rounding makes the two diverge
    (DeepSeek-V3's tiny model does at token 7: transformers' bf16 logits there are 0.420 / 0.348
    for tokens 14 / 115, the fp32 reference's 0.360 / 0.393), the fp32 runs must agree token for
    token, and at the first bf16 difference hetmoe's token must be the fp32 reference's choice or
    within bf16's resolution of it: the divergence is bf16 rounding, not a wrong computation."""
    path = tiny(model_type)
    prompt = tokens(1, (1, 8))
    kw = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": 0}
    ours = load_model(path, method="bf16").generate(prompt, **kw)
    theirs = reference(path, torch.bfloat16).generate(prompt, **kw)
    # Each stops at 32 tokens or at its end-of-sequence token: where the two diverge, one may end first.
    assert ours.shape[0] == theirs.shape[0] == 1 and min(ours.shape[1], theirs.shape[1]) > 8
    assert max(ours.shape[1], theirs.shape[1]) <= 8 + 32
    if torch.equal(ours, theirs):
        return
    ref32 = reference(path, torch.float32)
    ours32 = load_model(path, method="bf16", dtype=torch.float32).generate(prompt, **kw)
    assert torch.equal(ours32, ref32.generate(prompt, **kw))
    # The first difference lies within both: the shorter one's last token is its end of sequence, which
    # the longer one did not produce at that position.
    common = min(ours.shape[1], theirs.shape[1])
    first = int((ours[0, :common] != theirs[0, :common]).nonzero()[0])
    exact = logits(ref32, ours[:, :first])[0, -1]
    exact_choice = int(exact.argmax())
    # hetmoe's token is the fp32 reference's choice, or a near-tie below bf16's resolution there
    # (MiniMax-M2's tiny model at token 11: fp32 logits 0.4216 / 0.4197, 0.45% apart)
    gap = float(exact[exact_choice] - exact[int(ours[0, first])])
    assert gap <= 2**-7 * float(exact.abs().max()), (model_type, first, gap)


# --- memory -------------------------------------------------------------------------------------

_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from hetmoe import load_model
    from hetmoe.kernels.dispatch import engine_module

    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    # Imports (torch, transformers' modeling code: ~100 MB, the engine) are not the loader's: done
    # before the baseline.
    engine_module()
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
    # The peak is this process's own VmHWM, reset to the current RSS here. (Not ru_maxrss: Linux
    # folds the forking parent's high-water mark into it at exec.)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    model = load_model(sys.argv[1])
    peak = status("VmHWM")
    print(json.dumps({"before": before, "peak": peak, "experts": model.hetmoe.cpu_expert_bytes}))
    """
)


def test_peak_rss_while_loading_is_bounded_by_stored_experts(tmp_path: Path) -> None:
    """A 16-layer Qwen3-MoE whose experts (96 MiB) are ~50x its other weights: loading it grows the
    resident set by the stored experts plus the non-expert weights plus a working set bounded by
    one layer (4 MiB for its largest tensor), not by the model.

    The working set: each projection is validated (finite values) by the reader and again by the
    engine's checks, and torch.isfinite on bf16 makes temporaries of ~2.6x the tensor; 10x the
    largest tensor of one layer plus 16 MiB is allowed (the loader returns freed heap memory to the
    OS after each layer, so the temporaries do not pile up). Fused storage runs from the memory-
    mapped file; per-expert storage is stacked once per layer and the reader releases the source
    pages it copied, so both layouts hold one copy of the experts.
    """
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING["qwen3_moe"](
        vocab_size=128,
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        num_hidden_layers=16,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=32,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    layouts = {"fused": tmp_path / "fused", "per-expert": tmp_path / "per-expert"}
    model.save_pretrained(layouts["fused"], save_original_format=False)
    model.save_pretrained(layouts["per-expert"], save_original_format=True)
    expert_bytes = sum(p.numel() * 2 for n, p in model.named_parameters() if ".experts." in n)
    largest = max(p.numel() * 2 for n, p in model.named_parameters() if ".experts." in n)
    other_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    del model
    assert expert_bytes > 40 * other_bytes
    # Both loads at once (separate processes, so each measures only itself).
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _RSS_SCRIPT, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, path in layouts.items()
    }
    working_set = 10 * largest + (16 << 20)
    for name, proc in procs.items():
        out, err = proc.communicate()
        assert proc.returncode == 0, err[-2000:]
        m = json.loads(out.strip().splitlines()[-1])
        assert m["experts"] == expert_bytes
        grown = m["peak"] - m["before"]
        assert grown <= expert_bytes + other_bytes + working_set, (name, grown / 2**20, expert_bytes / 2**20)


def test_import_hetmoe_stays_cheap() -> None:
    code = "import sys, hetmoe; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_load_model_errors_are_clear(tiny) -> None:
    path = tiny("qwen3_moe")
    with pytest.raises(ValueError, match="method 'fp4'"):
        load_model(path, method="fp4")
    with pytest.raises(ValueError, match="group_size"):
        load_model(path, group_size=64)
    with pytest.raises(ValueError, match="placement"):
        load_model(path, gpu_experts=1, placement="hottest")
    hybrid = next(iter(load_model(path).hetmoe.layers.values()))
    with pytest.raises(RuntimeError, match="inference-only"):
        hybrid(torch.randn(1, 3, 64, dtype=torch.bfloat16, requires_grad=True))
