"""Reading routed experts from every supported architecture and storage, checked against transformers.

The tiny checkpoints are written by transformers' own ``save_pretrained`` (tests/tiny_models.py),
and the reference for every bf16 read is the model transformers itself loads from the same files,
so a wrong guess about a layout (which half of ``gate_up_proj`` is gate, gpt-oss's interleaving,
Mixtral's w1/w3/w2) fails here rather than in a forward pass.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import (
    EXPERT_INTERMEDIATE,
    HIDDEN,
    MODEL_TYPES,
    NUM_EXPERTS,
    TOP_K,
    TinyCache,
    load_state,
    read_json,
    to_fused,
    to_per_expert,
    write_checkpoint,
)

from hetmoe.checkpoint import open_source
from hetmoe.checkpoint.config import read_config
from hetmoe.checkpoint.experts import LayerExperts, codec_of, read_layer_experts
from hetmoe.checkpoint.layout import MoELayout, moe_layout
from hetmoe.checkpoint.quant_config import check_requested
from hetmoe.formats import get_codec, snr_db
from hetmoe.formats.registry import UnknownMethodError

QWEN_NAMES = ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj")
MIXTRAL_NAMES = (
    "block_sparse_moe.experts.{e}.w1",
    "block_sparse_moe.experts.{e}.w3",
    "block_sparse_moe.experts.{e}.w2",
)
FUSED_NAMES = ("mlp.experts.gate_up_proj", None, "mlp.experts.down_proj")
# What transformers 5.24's save_pretrained writes by default, per architecture: names and MoE layers.
SAVED = {
    "qwen3_moe": ("per_expert", QWEN_NAMES, (0, 1)),
    "qwen2_moe": ("per_expert", QWEN_NAMES, (0, 1)),
    "qwen3_next": ("per_expert", QWEN_NAMES, (0, 1)),
    "olmoe": ("per_expert", QWEN_NAMES, (0, 1)),
    "deepseek_v3": ("per_expert", QWEN_NAMES, (1, 2)),
    "deepseek_v2": ("per_expert", QWEN_NAMES, (1, 2)),
    "glm4_moe": ("per_expert", QWEN_NAMES, (1, 2)),
    "mixtral": ("per_expert", MIXTRAL_NAMES, (0, 1)),
    "minimax_m2": ("per_expert", MIXTRAL_NAMES, (0, 1)),
    "gpt_oss": ("gpt_oss", FUSED_NAMES, (0, 1)),
}
CASES = [(m, None) for m in MODEL_TYPES] + [(m, True) for m in MODEL_TYPES if m != "gpt_oss"]
# SNR floors (dB) per target method, relative to the source's own dequantization.
FLOORS = {"bf16": 45, "fp8": 25, "int8": 38, "int4": 19, "int4-asym": 20, "gptq": 17, "mxfp4": 14}
TARGETS = {
    "bf16": {},
    "fp8": {},
    "int8": {},
    "int4": {"group_size": 32},
    "int4-asym": {"group_size": 32},
    "gptq": {"group_size": 16},  # 16 divides both tiny K (64, 32)
    "mxfp4": {},
}


def _open(path: Path) -> tuple[object, MoELayout]:
    source = open_source(path)
    return source, moe_layout(read_config(path), source)


def _deq(q: object) -> torch.Tensor:
    return codec_of(q).dequantize(q, torch.float32)  # type: ignore[arg-type]


def _transformers_experts(path: Path, layer: int, model_type: str) -> dict[str, torch.Tensor]:
    """gate/up ``[E, I, H]``, down ``[E, H, I]`` and biases as transformers loads them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    experts = model.model.layers[layer].mlp.experts
    i = EXPERT_INTERMEDIATE
    if model_type == "gpt_oss":
        gu = experts.gate_up_proj
        return {
            "gate": gu[:, :, 0::2].transpose(1, 2),
            "up": gu[:, :, 1::2].transpose(1, 2),
            "down": experts.down_proj.transpose(1, 2),
            "gate_bias": experts.gate_up_proj_bias[:, 0::2],
            "up_bias": experts.gate_up_proj_bias[:, 1::2],
            "down_bias": experts.down_proj_bias,
        }
    return {"gate": experts.gate_up_proj[:, :i], "up": experts.gate_up_proj[:, i:], "down": experts.down_proj}


@pytest.mark.parametrize(("model_type", "fused"), CASES, ids=[f"{m}-{'fused' if f else 'saved'}" for m, f in CASES])
def test_bf16_experts_equal_transformers_parameters(tiny_cache: TinyCache, model_type: str, fused: bool | None) -> None:
    path = tiny_cache.model(model_type, fused)
    source, layout = _open(path)
    style, names, moe_layers = SAVED[model_type]
    if fused:
        style, names = "fused", FUSED_NAMES
    assert (layout.style, (layout.gate, layout.up, layout.down)) == (style, names)
    assert layout.moe_layers == moe_layers
    assert layout.prefix == "model.layers"
    assert (layout.num_experts, layout.top_k, layout.hidden_size) == (NUM_EXPERTS, TOP_K, HIDDEN)
    assert layout.intermediate_size == EXPERT_INTERMEDIATE
    assert layout.method == "bf16"
    for layer in layout.moe_layers:
        experts = read_layer_experts(source, layout, layer)
        ref = _transformers_experts(path, layer, model_type)
        for proj, q in experts.projections.items():
            assert q.method == "bf16" and q.tensors[".weight"].dtype == torch.bfloat16
            assert torch.equal(codec_of(q).dequantize(q, torch.bfloat16), ref[proj]), (layer, proj)
        if model_type == "gpt_oss":
            for proj, bias in experts.biases.items():
                assert torch.equal(bias, ref[f"{proj}_bias"]), (layer, proj)
            assert set(experts.biases) == {"gate", "up", "down"}
        else:
            assert experts.biases == {}
        assert experts.nbytes == sum(q.nbytes for q in experts.projections.values()) + sum(
            b.nbytes for b in experts.biases.values()
        )


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "minimax_m2", "deepseek_v3"])
def test_layout_rewrites_match_what_transformers_saves(tiny_cache: TinyCache, tmp_path: Path, model_type: str) -> None:
    saved, fused = tiny_cache.model(model_type), tiny_cache.model(model_type, True)

    def same(a: Path, b: Path) -> None:
        sa, sb = load_state(a), load_state(b)
        assert sorted(sa) == sorted(sb)
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key

    same(to_fused(saved, tmp_path / "fused"), fused)
    same(to_per_expert(fused, tmp_path / "per_expert"), saved)


def test_fused_and_gguf_reads_are_views_of_the_file(tiny_cache: TinyCache) -> None:
    source, layout = _open(tiny_cache.model("qwen3_moe", True))
    experts = read_layer_experts(source, layout, 1)
    stored = source.get("model.layers.1.mlp.experts.gate_up_proj")
    gate, up = experts.gate.tensors[".weight"], experts.up.tensors[".weight"]
    assert gate.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr()
    assert up.data_ptr() == stored.data_ptr() + EXPERT_INTERMEDIATE * HIDDEN * 2
    source, layout = _open(tiny_cache.gguf())
    experts = read_layer_experts(source, layout, 1)
    assert experts.down.tensors[".weight"].data_ptr() == source.get("blk.1.ffn_down_exps.weight").data_ptr()


def _written(path: Path, layout: MoELayout, layer: int, experts: LayerExperts) -> None:
    """Every stored tensor of every expert equals, byte for byte, what the checkpoint holds."""
    state = load_state(path)
    templates = {"gate": layout.gate, "up": layout.up, "down": layout.down}
    for proj, q in experts.projections.items():
        for suffix, stacked in q.tensors.items():
            for e in range(layout.num_experts):
                want = state[layout.key(layer, templates[proj], suffix, e)]
                assert stacked.dtype == want.dtype, (proj, suffix)
                assert torch.equal(stacked[e].view(torch.uint8), want.view(torch.uint8)), (proj, suffix, e)


@pytest.mark.parametrize(
    ("kind", "method", "params", "model_type"),
    [
        ("fp8", "fp8", {"block_size": [128, 128]}, "deepseek_v3"),
        ("int4", "int4", {"group_size": 32, "layout": "compressed-tensors"}, "deepseek_v3"),
        ("gptq", "gptq", {"group_size": 16, "sym": True, "checkpoint_format": "gptq"}, "qwen3_moe"),
    ],
)
def test_quantized_checkpoints_are_read_natively(
    tiny_cache: TinyCache, kind: str, method: str, params: dict, model_type: str
) -> None:
    path = getattr(tiny_cache, kind)()
    source, layout = _open(path)
    assert layout.model_type == model_type  # Kimi-K2's "kimi_k2" reads as DeepSeek-V3
    assert (layout.method, layout.params, layout.scheme.origin) == (method, params, "config")
    for layer in layout.moe_layers:
        experts = read_layer_experts(source, layout, layer)
        for q in experts.projections.values():
            assert (q.method, q.params) == (method, params)
        _written(path, layout, layer, experts)


def test_minimax_m2_fp8_convention(tiny_cache: TinyCache, tmp_path: Path) -> None:
    """MiniMax-M2's release: block_sparse_moe w1/w3/w2 in fp8, fmt "float8_e4m3fn", "gate" not converted."""
    from tiny_models import make_fp8

    qc = {"fmt": "float8_e4m3fn", "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    path = make_fp8(tiny_cache.model("minimax_m2"), tmp_path / "m2", **qc)
    source, layout = _open(path)
    assert (layout.gate, layout.method) == ("block_sparse_moe.experts.{e}.w1", "fp8")
    ref = _transformers_experts(tiny_cache.model("minimax_m2"), 1, "minimax_m2")
    experts = read_layer_experts(source, layout, 1)
    _written(path, layout, 1, experts)
    for proj, q in experts.projections.items():
        assert snr_db(ref[proj].float(), _deq(q)) > 25


def test_gpt_oss_mxfp4_matches_transformers_dequantization(tiny_cache: TinyCache) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path = tiny_cache.mxfp4()
    source, layout = _open(path)
    assert (layout.style, layout.method) == ("gpt_oss", "mxfp4")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, quantization_config=Mxfp4Config(dequantize=True)
    )
    state = load_state(path)
    for layer in layout.moe_layers:
        experts = read_layer_experts(source, layout, layer)
        ref = model.model.layers[layer].mlp.experts
        blocks = state[f"model.layers.{layer}.mlp.experts.gate_up_proj_blocks"]
        assert torch.equal(experts.gate.tensors["_blocks"], blocks[:, 0::2])  # the stored bytes, de-interleaved
        assert torch.equal(_deq(experts.gate).bfloat16(), ref.gate_up_proj[:, :, 0::2].transpose(1, 2))
        assert torch.equal(_deq(experts.up).bfloat16(), ref.gate_up_proj[:, :, 1::2].transpose(1, 2))
        assert torch.equal(_deq(experts.down).bfloat16(), ref.down_proj.transpose(1, 2))
        assert torch.equal(experts.gate_bias, ref.gate_up_proj_bias[:, 0::2])
        assert torch.equal(experts.down_bias, ref.down_proj_bias)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("kind", ["fp8", "int4", "mxfp4"])
def test_conversion_round_trips_within_floors(tiny_cache: TinyCache, kind: str, target: str) -> None:
    source, layout = _open(getattr(tiny_cache, kind)())
    layer = layout.moe_layers[-1]
    native = read_layer_experts(source, layout, layer)
    converted = read_layer_experts(source, layout, layer, target, **TARGETS[target])
    for proj, q in converted.projections.items():
        stored = native.projections[proj]
        # Parameters not asked for default to the stored ones when the method is the same.
        want = get_codec(
            target, **({**stored.params, **TARGETS[target]} if target == stored.method else TARGETS[target])
        )
        assert q.method == want.method and q.params == want.params
        want.validate(q, proj)
        snr = snr_db(_deq(native.projections[proj]), _deq(q))
        assert snr >= FLOORS[target], (proj, snr)
        if target == layout.method:
            assert q is native.projections[proj] or torch.equal(_deq(q), _deq(native.projections[proj]))
    assert converted.biases.keys() == native.biases.keys()


def test_gguf_mixed_types_read_natively(tiny_cache: TinyCache) -> None:
    import gguf
    import numpy as np

    path = tiny_cache.gguf()
    source, layout = _open(path)
    assert (layout.style, layout.prefix, layout.model_type, layout.moe_layers) == ("gguf", "blk", "deepseek_v3", (1, 2))
    assert (layout.num_experts, layout.hidden_size, layout.intermediate_size, layout.top_k) == (4, 256, 256, 2)
    reader = gguf.GGUFReader(path)
    raw = {t.name: t for t in reader.tensors}
    expected = {1: ("q4_k", "q4_k", "q6_k"), 2: ("q8_0", "q5_k", "q4_k")}
    for layer in layout.moe_layers:
        experts = read_layer_experts(source, layout, layer)
        for (proj, q), t in zip(experts.projections.items(), expected[layer], strict=True):
            assert q.method == f"gguf:{t}" and q.params == {"ggml_type": t.upper()}
            tensor = raw[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert np.array_equal(q.tensors[".weight"].numpy().reshape(-1), np.asarray(tensor.data).reshape(-1))
            reference = gguf.dequantize(tensor.data, tensor.tensor_type)
            assert np.array_equal(_deq(q).numpy().reshape(-1), reference.reshape(-1)), (layer, proj)
        for proj, bias in experts.biases.items():
            want = np.asarray(raw[f"blk.{layer}.ffn_{proj}_exps.bias"].data)
            assert np.array_equal(bias.numpy().reshape(-1), want.reshape(-1))
    # Asking for one projection's own type converts only the others.
    experts = read_layer_experts(source, layout, 1)
    q4 = read_layer_experts(source, layout, 1, "gguf:q4_k")
    assert q4.gate is not None and torch.equal(q4.gate.tensors[".weight"], experts.gate.tensors[".weight"])
    assert q4.down.method == "gguf:q4_k" and experts.down.method == "gguf:q6_k"
    assert snr_db(_deq(experts.down), _deq(q4.down)) > 19


def test_gguf_merged_gate_up(tmp_path: Path) -> None:
    import gguf
    from tiny_models import make_gguf

    path = make_gguf(tmp_path / "merged.gguf", merged_gate_up=True)
    source, layout = _open(path)
    assert (layout.gate, layout.up, layout.down) == ("ffn_gate_up_exps", None, "ffn_down_exps")
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.2.ffn_gate_up_exps.weight")
    merged = torch.from_numpy(gguf.dequantize(tensor.data, tensor.tensor_type).copy())
    experts = read_layer_experts(source, layout, 2)
    assert experts.gate.method == experts.up.method == "gguf:q8_0"
    assert torch.equal(_deq(experts.gate), merged[:, :256]) and torch.equal(_deq(experts.up), merged[:, 256:])


def test_compressed_tensors_fp8_block_and_channel(tiny_cache: TinyCache, tmp_path: Path) -> None:
    src = tiny_cache.model("qwen3_moe")
    state = load_state(src)
    for strategy, method, suffixes in (
        ("block", "fp8", {".weight_scale_inv": ".weight_scale"}),
        ("channel", "fp8-channel", {}),
    ):
        codec = get_codec(method)
        out: dict[str, torch.Tensor] = {}
        for key, t in state.items():
            if ".experts." in key:
                q = codec.quantize(t.float())
                module = key.removesuffix(".weight")
                out.update({module + suffixes.get(s, s): v for s, v in q.tensors.items()})
            else:
                out[key] = t
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy}
        if strategy == "block":
            weights["block_structure"] = [128, 128]
        config = read_json(src / "config.json")
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$"],
        }
        path = write_checkpoint(src, tmp_path / strategy, out, config)
        source, layout = _open(path)
        assert layout.method == method
        experts = read_layer_experts(source, layout, 1)
        ref = _transformers_experts(src, 1, "qwen3_moe")
        for proj, q in experts.projections.items():
            assert snr_db(ref[proj].float(), _deq(q)) > 25


@pytest.mark.parametrize(
    ("prefix", "wrapper"),
    [("model.language_model.layers", "qwen3_vl_moe"), ("language_model.model.layers", "kimi_k25")],
)
def test_multimodal_wrappers(tiny_cache: TinyCache, tmp_path: Path, prefix: str, wrapper: str) -> None:
    """Text config nested under text_config, layers under the wrapper's prefix, quant config on the wrapper."""
    src = tiny_cache.fp8()
    state = {
        k.replace("model.layers", prefix) if k.startswith("model.layers") else k: v for k, v in load_state(src).items()
    }
    text = read_json(src / "config.json")
    wrapper_config = {
        "model_type": wrapper,
        "text_config": text,
        "quantization_config": text.pop("quantization_config"),
    }
    path = write_checkpoint(src, tmp_path / "mm", state, wrapper_config)
    config = read_config(path / "model.safetensors")
    assert config["model_type"] == "deepseek_v3" and config["_wrapper_model_type"] == wrapper
    assert config["quantization_config"]["quant_method"] == "fp8"
    source, layout = _open(path)
    assert (layout.prefix, layout.method, layout.moe_layers) == (prefix, "fp8", (1, 2))
    _written(path, layout, 2, read_layer_experts(source, layout, 2))


def test_qwen3_vl_hub_fused_transposed(tiny_cache: TinyCache, tmp_path: Path) -> None:
    """Qwen3-VL-MoE's hub files keep gate_up_proj [E, H, 2I] (gate columns first) and down_proj [E, I, H]."""
    src = tiny_cache.model("qwen3_moe", True)
    state = {k: v.transpose(1, 2).contiguous() if ".mlp.experts." in k else v for k, v in load_state(src).items()}
    config = read_json(src / "config.json")
    config["model_type"] = "qwen3_vl_moe_text"
    source, layout = _open(write_checkpoint(src, tmp_path / "vl", state, config))
    assert layout.style == "fused_t"
    ref = _transformers_experts(src, 0, "qwen3_moe")
    experts = read_layer_experts(source, layout, 0)
    for proj, q in experts.projections.items():
        assert torch.equal(_deq(q).bfloat16(), ref[proj])


def test_fp16_experts_read_as_bf16(tiny_cache: TinyCache, tmp_path: Path) -> None:
    src = tiny_cache.model("olmoe")
    state = {k: v.half() if ".experts." in k else v for k, v in load_state(src).items()}
    source, layout = _open(write_checkpoint(src, tmp_path / "fp16", state))
    experts = read_layer_experts(source, layout, 0)
    assert experts.gate.tensors[".weight"].dtype == torch.bfloat16
    want = state["model.layers.0.mlp.experts.3.up_proj.weight"].bfloat16()
    assert torch.equal(experts.up.tensors[".weight"][3], want)


def test_check_requested() -> None:
    ct = {"group_size": 32, "layout": "compressed-tensors"}
    assert check_requested("fp8", None) is None
    assert check_requested("fp8", "fp8", {"block_size": [128, 128]}) is None
    assert check_requested("int4", "int4", ct) is None  # parameters default to the stored ones
    message = check_requested("fp8", "int4", {"block_size": [128, 128]}, {"group_size": 32})
    assert message is not None and "fp8" in message and "int4 g32" in message and "converted" in message
    message = check_requested("int4", "int4", ct, {"group_size": 64})
    assert message is not None and "converted" in message
    with pytest.raises(UnknownMethodError, match="unknown method"):
        check_requested("fp8", "int3")
    with pytest.raises(ValueError, match="decode-only"):
        check_requested("gguf:q4_k", "gguf:iq2_xxs")


def test_gguf_config_from_metadata(tiny_cache: TinyCache) -> None:
    config = read_config(tiny_cache.gguf())
    assert config["model_type"] == "deepseek_v3" and config["gguf_architecture"] == "deepseek2"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_experts"]) == (3, 256, 4)
    assert (config["num_experts_per_tok"], config["moe_intermediate_size"], config["first_k_dense_replace"]) == (
        2,
        256,
        1,
    )


def test_saved_config_names_are_understood(tiny_cache: TinyCache) -> None:
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts, the hubs as num_experts."""
    assert "num_local_experts" in json.loads((tiny_cache.model("qwen3_moe") / "config.json").read_text())
    assert "num_experts" in json.loads((tiny_cache.model("qwen2_moe") / "config.json").read_text())
