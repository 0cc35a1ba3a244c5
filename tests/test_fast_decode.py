"""The lean one-token decoder layer (models/fast_decode.py) against transformers' own forward."""

from __future__ import annotations

import pytest
import torch
from tiny_models import greedy_logits

from hetmoe.runtime.hybrid import HybridMoE
from hetmoe.runtime.kv_cache import growing_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _decoder_layers(model) -> list:
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def _fast_layers(model) -> list:
    return [m for m in _decoder_layers(model) if getattr(vars(m).get("forward"), "hetmoe_fast_decode", False)]


def _steps(model, ids: torch.Tensor, steps: int, fast: bool, cache_class=None) -> list[torch.Tensor]:
    layers = _decoder_layers(model)
    saved = {id(m): vars(m).get("forward") for m in layers}
    if not fast:
        for m in layers:
            vars(m).pop("forward", None)  # back to transformers' class forward
    try:
        with torch.inference_mode():
            cache = growing_cache(model.config) if cache_class is None else cache_class(config=model.config)
            return greedy_logits(model, ids, steps, cache)
    finally:
        for m in layers:
            if saved[id(m)] is not None:
                m.forward = saved[id(m)]


def _spy_on_block(monkeypatch) -> list[bool]:
    """Whether each call of fast_decode._one_token_block took the one-call step (appended per call)."""
    from tiny_models import spy_taken

    import hetmoe.models.fast_decode as fast_decode

    return spy_taken(monkeypatch, fast_decode, "_one_token_block")


def _transformers_steps(model, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """_steps with transformers' own causal LM and decoder layer forwards."""
    model_forward = vars(model).pop("forward")
    try:
        return _steps(model, ids, steps, fast=False)
    finally:
        model.forward = model_forward


@pytest.mark.parametrize("dense", ["bf16", "int8"])
def test_bit_identical_to_transformers_forward(tiny_cache, dense: str) -> None:
    from hetmoe import load_model

    model = load_model(tiny_cache.model("qwen3_moe"), dense_method=dense)
    assert len(_fast_layers(model)) == model.config.num_hidden_layers
    summary = model.hetmoe.summary(verbose=True)
    assert f"layers 0-1: attention one engine call a decode step (fast_decode.py); linears 4 engine {dense}" in summary
    assert "routed and run in the decode step's one call" in summary
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(0))
    fast = _steps(model, ids, 24, fast=True)
    slow = _steps(model, ids, 24, fast=False)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


def test_batches_and_masks_take_transformers_forward(tiny_cache) -> None:
    from hetmoe import load_model

    model = load_model(tiny_cache.model("qwen3_moe"), dense_method="bf16")
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: a mask reaches the layers
    with torch.inference_mode():
        fast = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        for m in _fast_layers(model):
            del m.forward
        slow = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(fast, slow)


def test_not_installed_without_fused_projections(tiny_cache) -> None:
    from hetmoe import load_model

    model = load_model(tiny_cache.model("qwen3_moe"), dense_method="torch")  # q/k/v stay torch Linears
    assert not _fast_layers(model)
    assert "attention transformers' layer, engine attention kernel, engine rotary; linears 4 torch" in (
        model.hetmoe.summary(verbose=True)
    )


@pytest.mark.parametrize("path", ["block", "direct"])
def test_one_token_engine_paths_are_bit_identical(tiny_cache, monkeypatch, path: str) -> None:
    """block: with a cache that appends in place, the layer's attention half and the router's logits
    are one engine call (decode_step.h); direct: with transformers' DynamicCache the norms and rotary
    embedding are direct engine calls. Each bit-identical to transformers' forward."""
    from transformers.cache_utils import DynamicCache

    import hetmoe.models.fast_decode as fast_decode
    from hetmoe import load_model
    from hetmoe.models.adapters.qwen3_moe import Qwen3MoeAdapter

    taken: dict[str, list[bool]] = {"_one_token_block": [], "_norm_rope_direct": []}
    for name, calls in taken.items():
        real = getattr(fast_decode, name)

        def spy(*args, real=real, calls=calls):
            out = real(*args)
            calls.append(out is not None)
            return out

        monkeypatch.setattr(fast_decode, name, spy)
    routed = {"route": 0, "route_logits": 0}
    for name in routed:
        real = getattr(Qwen3MoeAdapter, name)

        def count(self, *args, real=real, name=name):
            routed[name] += 1
            return real(self, *args)

        monkeypatch.setattr(Qwen3MoeAdapter, name, count)
    model = load_model(tiny_cache.model("qwen3_moe"), dense_method="bf16")
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    fast = _steps(model, ids, 6, fast=True, cache_class=DynamicCache if path == "direct" else None)
    block, direct = taken["_one_token_block"], taken["_norm_rope_direct"]
    if path == "block":
        assert block and all(block) and not direct
        # every decode step ran the whole layer in the block, routing included (csrc/routing.h, the
        # engine's softmax top-k, which route_logits also calls): route ran only for the prompt
        assert routed["route"] == layers and routed["route_logits"] == layers
    else:
        assert not any(block) and direct and all(direct)
    monkeypatch.undo()
    slow = _steps(model, ids, 6, fast=False, cache_class=DynamicCache if path == "direct" else None)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("vector_arithmetic")  # transformers' forward runs lm_head on every prompt row
def test_model_forward_is_fast_and_bit_identical_in_generate(tiny_cache) -> None:
    """The causal LM's one-token forward (no transformers model glue) gives generate the same tokens
    and the same scores as transformers' forward."""
    from hetmoe import load_model

    model = load_model(tiny_cache.model("qwen3_moe"), dense_method="int8")
    assert "forward" in vars(model)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with torch.inference_mode():
        fast = model.generate(ids, cache=growing_cache(model.config), **kwargs)
        del model.forward
        for m in _fast_layers(model):
            del m.forward
        slow = model.generate(ids, cache=growing_cache(model.config), **kwargs)
    assert torch.equal(fast.sequences, slow.sequences)
    for a, b in zip(fast.scores, slow.scores, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "glm4_moe", "minimax_m2"])
def test_whole_layer_in_one_call_counts_experts_and_steps_aside_for_recorded_routing(
    tiny_cache, monkeypatch, model_type: str
) -> None:
    """Where the block runs the whole layer (decode_step.h's DecodeMoEHalf: Qwen3-MoE's softmax top-k
    and MiniMax-M2's sigmoid router from the block's logits; GLM-4-MoE's grouped router and shared
    experts through DecodeFFN, whose dense first layer runs its MLP in the block too), it adds each
    decode token's experts to the HybridMoE's counts, as forward_routed does. Recording routing is
    forward_routed's work in Python, so the layer's MoE half then runs there again; it routes alike,
    so the recorded counts equal the block's, and the logits are bit-identical."""
    from tiny_models import check_block_counts_and_recorded_routing

    from hetmoe import load_model

    model = load_model(tiny_cache.model(model_type), dense_method="bf16")
    # GLM-4-MoE's dense first layer runs its MLP in the block too
    check_block_counts_and_recorded_routing(
        model, monkeypatch, lambda m, ids, n: _steps(m, ids, n, fast=True), model_type == "glm4_moe"
    )


def test_block_follows_a_norm_weight_whose_storage_changed(tiny_cache) -> None:
    """``param.data = ...`` keeps the Parameter object but frees the memory the one-call decode block
    read its norm weight from: the block is rebuilt on the new storage, and the steps stay
    bit-identical to transformers' forward with the new weights."""
    from hetmoe import load_model

    model = load_model(tiny_cache.model("qwen3_moe"), dense_method="bf16")
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    _steps(model, ids, 3, fast=True)  # the blocks exist, pointing at the norms' first storage
    layer = _fast_layers(model)[0]
    for norm in (layer.input_layernorm, layer.self_attn.q_norm, layer.post_attention_layernorm):
        old = norm.weight.data_ptr()
        norm.weight.data = norm.weight.data * 1.5 + 0.25  # new storage, different values
        assert norm.weight.data_ptr() != old
    fast = _steps(model, ids, 6, fast=True)
    slow = _steps(model, ids, 6, fast=False)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)


# Each family the one-token step covers (MoEAdapter.decode_layer), with the variants that change its
# arithmetic: biases on q/k/v (Qwen2-MoE by default, GLM-4-MoE's attention_bias), q/k norms per head
# (Qwen3-MoE, GLM-4-MoE's use_qk_norm), over the whole projection (OLMoE, MiniMax-M2) or none, and
# rotary over all of each head (Qwen3-MoE, Mixtral, ...) or its leading half (GLM-4-MoE's default,
# MiniMax-M2's rotary_dim); gpt-oss's sinks, biases, half-width rotary tables and sliding-window
# layers (window 16: the 7-token prompt and 24 steps run past it).
_HALF_ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
FAMILIES = {
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),  # a shared expert 48 wide: its down projection stays in torch
    "qwen2_moe-shared-64": ("qwen2_moe", {"shared_expert_intermediate_size": 64}),  # all of it in the engine
    "mixtral": ("mixtral", {}),
    "olmoe": ("olmoe", {}),
    "minimax_m2": ("minimax_m2", {}),
    "minimax_m2-partial-rotary": ("minimax_m2", {"rope_parameters": _HALF_ROTARY}),
    "glm4_moe": ("glm4_moe", {}),
    "glm4_moe-qk-norm-bias": ("glm4_moe", {"use_qk_norm": True, "attention_bias": True}),
    "gpt_oss": ("gpt_oss", {}),
}


@pytest.fixture(scope="module")
def family_models(tmp_path_factory) -> dict:
    from tiny_models import build_tiny

    root = tmp_path_factory.mktemp("families")
    return {name: build_tiny(arch, root / name, **extra) for name, (arch, extra) in FAMILIES.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_decodes_in_one_call_bit_identical(family_models, monkeypatch, family: str, dtype) -> None:
    """Every decoder layer of each family takes the one-call step (the engine block, every step), and
    24 greedy steps give logits bit-identical to transformers' own forward over the same modules: the
    stored bf16 model as loaded by default, and an fp32 load with int8 linears (an fp32 load keeps
    bf16 weights in torch unless a method is named)."""
    import hetmoe.models.fast_decode as fast_decode
    from hetmoe import load_model

    options = {} if dtype == torch.bfloat16 else {"dtype": dtype, "dense_method": "int8"}
    model = load_model(family_models[family], **options)
    assert len(_fast_layers(model)) == model.config.num_hidden_layers == len(_decoder_layers(model))
    assert "forward" in vars(model)  # the causal LM's one-token forward too
    taken = _spy_on_block(monkeypatch)
    moe = [m for m in model.modules() if isinstance(m, HybridMoE)]
    adapter = type(moe[0].adapter)
    from_logits: list[bool] = []
    real_route = adapter.route_logits

    def route_spy(self, *args):
        out = real_route(self, *args)
        from_logits.append(out is not None)
        return out

    monkeypatch.setattr(adapter, "route_logits", route_spy)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    fast = _steps(model, ids, 24, fast=True)
    assert len(taken) == 24 * model.config.num_hidden_layers and all(taken)
    # The block computes the router's logits (gpt-oss's with its bias) where the adapter routes from
    # them and the router weight is bf16. GLM-4-MoE's router takes fp32 products, so it does not (its
    # bf16 block runs the layer's MoE half from h_out instead, decode_step.h's DecodeFFN); MiniMax-M2's
    # rounds x to the weight's dtype first, so an fp32 load's logits are refused and it routes itself.
    # Qwen3-MoE's, Mixtral's, OLMoE's, gpt-oss's and MiniMax-M2's bf16 blocks then route from those
    # logits and run the experts themselves (decode_step.h's DecodeMoEHalf: the engine's softmax top-k
    # or MiniMax-M2's sigmoid router, which route_logits calls too), so route_logits ran only for the
    # prompt (MiniMax-M2's route does not go through it); their fp32 loads keep an fp32 router, which
    # the block does not run.
    # Qwen2-MoE's gated shared expert joins the block's call where all of its linears run in the
    # engine (not the 48-wide one: 48 is no whole number of the engine's 32-wide blocks). The fp32
    # loads keep their routers out of the block, except GLM-4-MoE's, whose fp32 router the block runs
    # from h_out in both dtypes (DecodeFFN: routing.h's router_logits_f32).
    in_block = all(fast_decode.whole_layer_in_one_call(m) for m in moe)
    expected = (dtype == torch.bfloat16 and family != "qwen2_moe") or family.startswith("glm4_moe")
    assert in_block == expected, family
    if family.startswith("glm4_moe") or (family.startswith("minimax_m2") and dtype == torch.float32):
        assert not any(from_logits)
    elif family.startswith("minimax_m2"):
        assert from_logits == [], from_logits
    elif in_block:
        assert from_logits == [True] * len(moe), from_logits
    else:
        assert len(from_logits) >= 24 * len(moe) and all(from_logits[-24 * len(moe) :]), from_logits
    monkeypatch.undo()
    slow = _transformers_steps(model, ids, 24)
    for step, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert torch.equal(a, b), (family, step, float((a - b).abs().max()))


def _unfuse_qkv(layers: list) -> None:
    """Each layer's fused q/k/v linear as three engine linears in three methods (int8, bf16, int4), as
    a Q4_K_M file's attention stays (attn_v in Q6_K beside Q4_K q and k cannot be fused)."""
    from hetmoe.runtime.cpu_linear import CPULinear

    for layer in layers:
        attn = layer.self_attn
        group = attn._modules.pop("fused_qkv_proj")
        w, bias, b = group.linear.dequantized(torch.float32), group.linear.bias_f32, group.bounds
        for i, (name, method) in enumerate(zip(("q_proj", "k_proj", "v_proj"), ("int8", "bf16", "int4"), strict=True)):
            rows = slice(b[i], b[i + 1])
            kind = {"group_size": 32} if method == "int4" else {}
            setattr(attn, name, CPULinear(w[rows], None if bias is None else bias[rows], method, **kind))


@pytest.mark.usefixtures("vector_arithmetic")  # the reference's prompt rows and ours, one arithmetic
@pytest.mark.parametrize(
    ("dtype", "separate"), [(torch.bfloat16, False), (torch.float32, False), (torch.float32, True)]
)
def test_qwen3_next_full_attention_layers_decode_in_one_call(tmp_path, monkeypatch, dtype, separate: bool) -> None:
    """Qwen3-Next's full-attention layers (the query's gate: output times sigmoid(gate) before o_proj;
    offset-scale q/k norms; partial rotary) take the one-call step every step, its delta-net layers
    keep their own forward, and 24 greedy steps give transformers' logits over the same modules; also
    with q (query and gate rows), k and v as three linears in three methods.

    Bound: every kernel is the one transformers' forward calls here except the gate's sigmoid, which
    the engine computes as 1 / (1 + expf(-g)) with libm's expf where torch uses its vectorized exp:
    each within an ulp of exp, so the two sigmoids differ by at most 2 ulp (2 * 2^-23 relative), and
    in bf16 they coincide once rounded unless one lies within an ulp of a bf16 rounding boundary
    (none of this model's does: bit-identical). In fp32 that 2.4e-7 of a gate factor reaches the
    logits through o_proj, the residual stream's norms and the later layers' linears, each of which
    changes a relative error by at most a small factor at this scale: 1e-6 of the logits' largest
    magnitude (~4x; measured 2.2e-7 on one step of 24, the others bit-identical)."""
    from tiny_models import build_tiny

    from hetmoe import load_model

    options = {} if dtype == torch.bfloat16 else {"dtype": dtype, "dense_method": "int8"}
    model = load_model(build_tiny("qwen3_next", tmp_path / "m"), **options)
    kinds = model.config.layer_types
    assert "full_attention" in kinds and "linear_attention" in kinds
    fast = _fast_layers(model)
    assert [layer.self_attn.layer_idx for layer in fast] == [i for i, k in enumerate(kinds) if k == "full_attention"]
    summary = model.hetmoe.summary(verbose=True)
    assert f"layer {kinds.index('full_attention')}: attention one engine call a decode step" in summary
    delta = "attention delta net: transformers' layer in torch, its one-token rule in the engine (delta_rule.py)"
    assert f"layer {kinds.index('linear_attention')}: {delta}" in summary
    if separate:
        _unfuse_qkv(fast)
    taken = _spy_on_block(monkeypatch)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    steps = _steps(model, ids, 24, fast=True)
    assert len(taken) == 24 * len(fast) and all(taken)
    monkeypatch.undo()
    # transformers' decoder layer forwards; the causal LM's forward is the same in both runs (it gets no
    # one-token forward where not every layer takes the step)
    reference = _steps(model, ids, 24, fast=False)
    for step, (a, b) in enumerate(zip(steps, reference, strict=True)):
        if dtype == torch.bfloat16:
            assert torch.equal(a, b), (step, float((a - b).abs().max()))
        else:
            assert float((a - b).abs().max()) <= 1e-6 * float(b.abs().max()), step


def test_separate_qkv_linears_take_the_one_call_step(family_models, monkeypatch) -> None:
    """q/k/v in different methods stay three linears (a Q4_K_M file keeps attn_v in Q6_K beside Q4_K q
    and k, which cannot be fused): the one-call step runs them side by side, and 24 steps stay
    bit-identical to transformers' forward over the same three linears."""
    from hetmoe import load_model

    model = load_model(family_models["qwen2_moe"], dtype=torch.float32, dense_method="int8")  # q/k/v biases
    _unfuse_qkv(_fast_layers(model))
    taken = _spy_on_block(monkeypatch)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(6))
    fast = _steps(model, ids, 24, fast=True)
    assert len(taken) == 24 * model.config.num_hidden_layers and all(taken)
    monkeypatch.undo()
    slow = _transformers_steps(model, ids, 24)
    for step, (a, c) in enumerate(zip(fast, slow, strict=True)):
        assert torch.equal(a, c), (step, float((a - c).abs().max()))
