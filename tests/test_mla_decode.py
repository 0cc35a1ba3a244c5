"""The one-call decode step for latent attention (models/mla_decode.py, csrc/mla_step.h) against the
absorbed forward it stands in for (models/mla_attention.py inside transformers' decoder layers),
which tests/test_mla_attention.py holds against transformers' own attention at 1e-5."""

from __future__ import annotations

import pytest
import torch
from conftest import engine_isas
from tiny_models import greedy_logits

from hetmoe.runtime.kv_cache import growing_cache

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INT_BOUND = 3e-4  # the engine's integer GEMVs: activations in int16 per block of 32 (tests/test_cpu_linear.py)

# Widths the engine's kernels take (nope, rank and rope multiples of 16); q_lora or not, each
# architecture's rotation (V3 interleaved pairs or rotate_half, V2 complex factors) and V3's YaRN
# (mscale in the attention's scaling, the tables scaled).
_WIDTHS = {"kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16}
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
VARIANTS = {
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-no-q-lora": ("deepseek_v3", {"q_lora_rank": None}),
    "deepseek_v3-rotate-half": ("deepseek_v3", {"rope_interleave": False}),
    "deepseek_v3-yarn": ("deepseek_v3", {"rope_parameters": _YARN, "max_position_embeddings": 2560}),
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v2-no-q-lora": ("deepseek_v2", {"q_lora_rank": None}),
}


@pytest.fixture(scope="module")
def mla_models(tmp_path_factory) -> dict:
    from tiny_models import build_tiny

    root = tmp_path_factory.mktemp("mla")
    return {name: build_tiny(arch, root / name, **(_WIDTHS | extra)) for name, (arch, extra) in VARIANTS.items()}


def _greedy(model, ids: torch.Tensor, steps: int, fast: bool) -> list[torch.Tensor]:
    """Logits of ``steps`` greedy one-token steps after the prompt; ``fast=False`` with transformers'
    decoder layer and causal LM forwards (the absorbed attention stays installed)."""
    layers = list(model.model.layers)
    saved = [vars(m).get("forward") for m in [model, *layers]]
    if not fast:
        for m in [model, *layers]:
            vars(m).pop("forward", None)
    try:
        with torch.inference_mode():
            return greedy_logits(model, ids, steps, growing_cache(model.config))
    finally:
        for m, forward in zip([model, *layers], saved, strict=True):
            if forward is not None:
                m.forward = forward


def _spy(monkeypatch) -> list[bool]:
    """Whether each call of the one-call step ran it (appended per call)."""
    from tiny_models import spy_taken

    import hetmoe.models.fast_decode as fast_decode

    return spy_taken(monkeypatch, fast_decode, "one_token_mla")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_layer_decodes_in_one_call_bit_identical(mla_models, monkeypatch, variant: str) -> None:
    """With no flags, every decoder layer of each variant takes the one-call step on every token (the
    dense first layer too), and 24 greedy steps give logits bit-identical to the absorbed forward
    through transformers' layers: the same kernels in the same order, so no bound is needed."""
    from hetmoe import load_model

    model = load_model(mla_models[variant])
    assert model.dtype == torch.bfloat16
    layers = model.config.num_hidden_layers
    taken = _spy(monkeypatch)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(5))
    fast = _greedy(model, ids, 24, fast=True)
    assert len(taken) == 24 * layers and all(taken)
    monkeypatch.undo()
    slow = _greedy(model, ids, 24, fast=False)
    for step, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert torch.equal(a, b), (variant, step, float((a - b).abs().max()))


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v2-no-q-lora"])
def test_whole_layer_in_one_call_counts_experts_and_steps_aside_for_recorded_routing(
    mla_models, monkeypatch, variant: str
) -> None:
    """The one-call step runs each layer's second half too (decode_step.h: DecodeMLP for the dense
    first layer; DecodeMoEHalf for the MoE layers, grouped routing from the fp32 router, shared
    experts included), adding each decode token's experts to the HybridMoE's counts as forward_routed
    does. Recording routing is forward_routed's work in Python, so the MoE half then runs there again;
    it routes alike, so the recorded counts equal the block's and the logits are bit-identical."""
    from tiny_models import check_block_counts_and_recorded_routing

    from hetmoe import load_model

    model = load_model(mla_models[variant])
    summary = model.hetmoe.summary(verbose=True)
    assert "routed and run in the decode step's one call" in summary
    assert "mlp dense, run in the decode step's one call" in summary  # the first layer
    check_block_counts_and_recorded_routing(model, monkeypatch, lambda m, ids, n: _greedy(m, ids, n, fast=True), True)


def test_moe_half_follows_replaced_counts(mla_models) -> None:
    """The block increments the HybridMoE's counts through a pointer: after the tensor is replaced
    (HybridMoE.attach makes a new one), the next steps count into the new tensor, and decode the same."""
    from hetmoe import load_model
    from hetmoe.runtime.hybrid import HybridMoE

    model = load_model(mla_models["deepseek_v3"])
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(7))
    before = _greedy(model, ids, 4, fast=True)
    moe = [m for m in model.modules() if isinstance(m, HybridMoE)]
    for m in moe:
        m._cpu_counts = torch.zeros_like(m.cpu_counts)  # (reading cpu_counts adds the ones held back)
    after = _greedy(model, ids, 4, fast=True)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(int(m.cpu_counts.sum()) == (5 + 4) * model.config.num_experts_per_tok for m in moe)


def test_the_cache_holds_only_latent_rows(mla_models) -> None:
    """After the prompt and the one-call steps, each layer's cache is the latent rows alone: rank + rope
    values a token (keys) and zero-wide values, as hetmoe plan states."""
    from hetmoe import load_model

    model = load_model(mla_models["deepseek_v3"])
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache = growing_cache(model.config)
        out = model(ids, cache=cache, use_cache=True)
        for _ in range(3):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    for layer in cache.layers:
        assert layer.keys.shape == (1, 1, 8, _WIDTHS["kv_lora_rank"] + _WIDTHS["qk_rope_head_dim"])
        assert layer.values.shape == (1, 1, 8, 0)


def test_fp32_and_other_caches_take_transformers_forward(mla_models, monkeypatch) -> None:
    """The step is bf16 only: an fp32 load (engine linears in int8, so its layers have what the step
    reads) runs the absorbed forward through transformers' layers, and so does a cache that does not
    append in place (transformers' DynamicCache); both still decode."""
    from transformers import DynamicCache

    from hetmoe import load_model

    model = load_model(mla_models["deepseek_v3"], dtype=torch.float32, dense_method="int8")
    taken = _spy(monkeypatch)
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        cache = growing_cache(model.config)
        out = model(ids, cache=cache, use_cache=True)
        model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert taken and not any(taken)
    taken.clear()
    model = load_model(mla_models["deepseek_v3"])
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(ids, cache=cache, use_cache=True)
        step = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True)
    assert taken and not any(taken)
    assert torch.isfinite(step.logits.float()).all()


def test_block_refuses_shapes_it_cannot_run() -> None:
    """The constructor names what does not fit instead of reading past a buffer."""
    from hetmoe.kernels.dispatch import engine_module

    m = engine_module()
    norms = ((1, 1e-6, 0),) * 4

    def make(nope: int, rope_mode: int) -> None:
        none = (None, None, None)
        m.DecodeMLABlock(64, 4, nope, 16, 32, 16, 0, norms, rope_mode, 1.0, *none, (1, 0, 0), (1, 0, 0), None)

    with pytest.raises(ValueError, match="multiples of 16"):
        make(8, 0)
    with pytest.raises(ValueError, match="rope_mode"):
        make(16, 3)
    with pytest.raises(ValueError, match="q_in must map"):
        make(16, 0)


def test_block_follows_kv_b_changed_in_place(mla_models) -> None:
    """The block reads a transposed copy of kv_b_proj's W_UK: after the weight's values change in place
    (a merged adapter, say), the next steps use the new values, exactly as a model changed before its
    first step does."""
    from hetmoe import load_model

    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    used = load_model(mla_models["deepseek_v3"])
    _greedy(used, ids, 3, fast=True)  # the blocks and their copies made
    fresh = load_model(mla_models["deepseek_v3"])
    with torch.no_grad():
        for model in (used, fresh):
            for layer in model.model.layers:
                layer.self_attn.kv_b_proj.weight.mul_(0.5)
    for a, b in zip(_greedy(used, ids, 6, fast=True), _greedy(fresh, ids, 6, fast=True), strict=True):
        assert torch.equal(a, b)


# The per-head products on a GGUF file's own blocks (attn_k_b [heads, rank, nope], attn_v_b [heads, v,
# rank]): what llama.cpp's quantizer gives them (K = nope 128 in 32-blocks, K = rank 512 in K-quants too).
_HEAD_BLOCKS = [("gguf:q8_0", 128), ("gguf:q4_0", 128), ("gguf:q5_0", 128), ("gguf:q4_k", 512), ("gguf:q6_k", 512)]


@pytest.mark.parametrize("isa", engine_isas())
@pytest.mark.parametrize(("method", "k"), _HEAD_BLOCKS)
def test_head_gemv_on_stored_blocks_matches_each_heads_product(method: str, k: int, isa: str) -> None:
    """``head_gemv`` with a head per "expert" of the projection: y[h] = W_h x_h for every head, against
    float64 on the same stored bytes (pure torch dequantization). Each head's x is quantized to int16 per
    block of 32 as the engine's integer GEMVs do, so the bound is theirs (tests/test_cpu_linear.py: 3e-4).
    x rows lie apart (the decode step's rows carry the rope part after them), and heads hold different
    weights and inputs, so a head reading another's would miss by ~100%."""
    from hetmoe.formats import QuantizedTensor, get_codec
    from hetmoe.kernels.dispatch import engine_module, select_isa
    from hetmoe.runtime.engine_layout import engine_projection

    select_isa(isa)
    heads, n, stride = 4, 48, k + 16
    g = torch.Generator().manual_seed(1)
    codec = get_codec(method)
    flat = codec.quantize(torch.randn(heads * n, k, generator=g) * 0.05)
    stacked = {s: t.reshape(heads, n, -1) for s, t in flat.tensors.items()}  # a head an "expert"
    q = QuantizedTensor(method, (heads, n, k), stacked, flat.params)
    w = codec.dequantize(flat, torch.float32).double().view(heads, n, k)
    x = torch.randn(heads, stride, generator=g)
    y = torch.full((heads, n), float("nan"))
    proj = engine_projection(q, "attn_k_b")
    assert not proj.note  # the stored blocks, not a transcoded copy
    engine_module().head_gemv(proj.descriptor(n, k), heads, x.data_ptr(), stride, y.data_ptr())
    ref = torch.einsum("hnk,hk->hn", w, x[:, :k].double())
    assert float((y.double() - ref).norm() / ref.norm()) < INT_BOUND
