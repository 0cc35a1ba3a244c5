"""load_model on llama.cpp GGUF files, against transformers running the same weights.

Each test builds a tiny random transformers model, writes it as llama.cpp's ``convert_hf_to_gguf.py``
would (tensor names from the ``gguf`` package's own name map, the metadata keys and the deepseek2
kv_b_proj split of the converter, every tensor quantized by ``gguf.quants.quantize``), and loads the
model transformers sees when each of its tensors is replaced by ``gguf.quants.dequantize`` of the same
bytes. hetmoe reads the file on its own (its config from the metadata, non-expert tensors through its
GGUF decoders, routed experts straight into the CPU engine as Q8_0 / Q4_0 blocks).

What is compared (``rel(a, b) = max|a - b| / max|b|`` over all logits):

- float32 models: the same weights, so only summation order and the engine's int16 activation
  quantization (its integer dot products with the Q8_0/Q4_0 codes) differ: rel <= 5e-5 (measured:
  5e-7 to 1.1e-5, the most with DeepSeek's routed_scaling_factor 2.5); with the experts on the torch
  fallback, which dequantizes exactly, rel <= 1e-6 (measured: 0, bit-identical to transformers).
  These run on the vector kernels (conftest.py: vector_arithmetic), which use the stored codes as
  they are for any number of tokens. On AMX a prompt's Q4_0, Q8_0 and Q6_K rows also move onto a
  row-wide int16 grid (the int8 digit tiles, each weight within 1/32639 of its row's range), another
  arithmetic: whole models measured 6e-5 to 9e-5 there, and tests/test_amx.py holds the tiles to
  their own stated bounds and to the emulator.
- the default bf16 model: transformers rounds to bf16 after every op and hetmoe's engine only at the
  end of a layer, so neither is "the" answer (transformers' own bf16 run is ~1e-2 from fp32): hetmoe's
  distance to the fp32 reference must be at most transformers' bf16 distance x 1.25 plus one bf16 ulp,
  the rule tests/test_hybrid.py applies to safetensors checkpoints.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

import gguf
from gguf.quants import dequantize, quantize
from tiny_models import logits, rel, spy_taken, tiny_config, tokens
from transformers import AutoModelForCausalLM, AutoTokenizer

from hetmoe import load_model
from hetmoe.checkpoint import CheckpointError
from hetmoe.cli.main import main
from hetmoe.models.default import default_model_path
from hetmoe.models.gguf_model import load_gguf_tokenizer
from hetmoe.models.planner import kv_bytes_per_token, plan_memory
from hetmoe.runtime.cpu_linear import CPULinear
from hetmoe.runtime.kv_cache import growing_cache
from hetmoe.runtime.stored_embedding import StoredEmbedding

pytestmark = pytest.mark.usefixtures("one_torch_thread")

Q = gguf.GGMLQuantizationType
ARCH = {
    "qwen3_moe": "qwen3moe",
    "qwen2_moe": "qwen2moe",
    "deepseek_v3": "deepseek2",
    "deepseek_v2": "deepseek2",
    "glm4_moe": "glm4moe",
    "minimax_m2": "minimax-m2",
    "gpt_oss": "gpt-oss",
    "olmoe": "olmoe",
    "mixtral": "llama",
    "qwen3_next": "qwen3next",
}
# the gguf package's MODEL_ARCH names
ARCH_ENUM = {"glm4moe": "GLM4_MOE", "minimax-m2": "MINIMAXM2", "gpt-oss": "GPT_OSS", "qwen3next": "QWEN3NEXT"}
# Per MoE layer (alternating): the ggml types of gate, up and down. gpt-oss files hold MXFP4 experts
# (what convert_hf_to_gguf writes from the released checkpoints); one Q8_0 projection checks the mix.
EXPERT_TYPES = [(Q.Q8_0, Q.Q4_0, Q.Q8_0), (Q.Q4_0, Q.Q8_0, Q.Q4_0)]
GPT_OSS_EXPERT_TYPES = [(Q.MXFP4, Q.MXFP4, Q.MXFP4), (Q.MXFP4, Q.Q8_0, Q.MXFP4)]
# Non-expert tensors: norms and vectors F32 (as llama.cpp keeps them), these leaves as given, the rest Q8_0.
LEAF_TYPES = {"attn_q": Q.F16, "attn_k": Q.BF16, "ffn_gate_inp": Q.F32, "attn_kv_a_mqa": Q.BF16}

# The float32 comparisons' arithmetic: the codes as stored at every token count (the module's docstring).
ONE_ARITHMETIC = pytest.mark.usefixtures("vector_arithmetic")


# DeepSeek-V3's rope scaling, shrunk to the tiny model's context (mscale == mscale_all_dim, as released).
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}


# MiniMax-M2's rotary part (64 of its 128 head dims), on the tiny model's heads of 16.
HALF_ROTARY = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}


# --- writing a GGUF the way convert_hf_to_gguf.py does ---------------------------------------------


def random_model(model_type: str, **overrides: Any) -> torch.nn.Module:
    """A tiny random transformers model whose experts, norms and router biases are re-drawn, so that a
    mix-up of gate and up, of two experts or of two norms changes the logits."""
    fields = dict(overrides)
    if model_type == "qwen3_moe":
        fields.setdefault("norm_topk_prob", True)  # llama.cpp's qwen3moe graph always renormalises
    if model_type.startswith("deepseek"):
        fields.setdefault("head_dim", 8)  # = qk_rope_head_dim, as transformers' DeepSeek attention needs
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **fields), dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if ".experts." in name:
                p.copy_(0.02 * noise)
            elif name.endswith("norm.weight"):  # transformers initialises every norm to ones
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * noise)
    return model.eval()


def _text_model_metadata(c: Any) -> dict[str, Any]:
    """The keys every TextModel writes (conversion/base.py set_gguf_parameters)."""
    return {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "rope.freq_base": float(c.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        "expert_used_count": c.num_experts_per_tok,
    }


def _metadata(config: Any, arch: str, split_kv_b: bool) -> dict[str, Any]:
    """The ``{arch}.*`` keys convert_hf_to_gguf.py writes for this config (TextModel + the model class)."""
    c = config
    if arch in ("glm4moe", "minimax-m2"):
        return _partial_rotary_metadata(c, arch)
    if arch == "llama":  # Mixtral: TextModel's keys + LlamaModel's (no expert length: the feed-forward one)
        return _text_model_metadata(c) | {
            "expert_count": c.num_local_experts,
            "rope.dimension_count": c.head_dim,
            "attention.key_length": c.head_dim,
            "attention.value_length": c.head_dim,
        }
    if arch == "olmoe":  # TextModel's keys + OlmoeModel's (conversion/olmo.py): rms eps fixed at 1e-5
        return _text_model_metadata(c) | {"expert_count": c.num_experts, "attention.layer_norm_rms_epsilon": 1e-5}
    if arch == "gpt-oss":  # TextModel's keys (rope scaling included) + GptOssModel's (conversion/gpt_oss.py)
        rope = c.rope_parameters
        return _text_model_metadata(c) | {
            "expert_count": c.num_local_experts,
            "expert_feed_forward_length": c.intermediate_size,
            "attention.key_length": c.head_dim,
            "attention.value_length": c.head_dim,
            "attention.sliding_window": c.sliding_window,
            "rope.scaling.type": "yarn",
            "rope.scaling.factor": float(rope["factor"]),
            "rope.scaling.original_context_length": rope["original_max_position_embeddings"],
            "rope.scaling.yarn_beta_fast": float(rope["beta_fast"]),
            "rope.scaling.yarn_beta_slow": float(rope["beta_slow"]),
        }
    meta = _text_model_metadata(c) | {
        "expert_feed_forward_length": c.moe_intermediate_size,
    }
    if arch == "qwen3next":  # Qwen2MoeModel's keys + Qwen3NextModel's (conversion/qwen.py)
        return meta | {
            "expert_count": c.num_experts,
            "expert_shared_feed_forward_length": c.shared_expert_intermediate_size,
            "attention.key_length": c.head_dim,
            "attention.value_length": c.head_dim,
            "ssm.conv_kernel": c.linear_conv_kernel_dim,
            "ssm.state_size": c.linear_key_head_dim,
            "ssm.group_count": c.linear_num_key_heads,
            "ssm.time_step_rank": c.linear_num_value_heads,
            "ssm.inner_size": c.linear_value_head_dim * c.linear_num_value_heads,
            "attention.recurrent_layers": [t == "linear_attention" for t in c.layer_types],
            "full_attention_interval": 4,  # written whatever layer_types says: the flags above win
            "rope.dimension_count": int(c.head_dim * c.rope_parameters["partial_rotary_factor"]),
        }
    if arch in ("qwen2moe", "qwen3moe"):
        meta["expert_count"] = c.num_experts
        if getattr(c, "head_dim", None):
            meta["attention.key_length"] = meta["attention.value_length"] = c.head_dim
        if arch == "qwen2moe":
            meta["expert_shared_feed_forward_length"] = c.shared_expert_intermediate_size
        return meta
    meta |= {
        "attention.head_count_kv": 1,  # MLA as MQA
        "leading_dense_block_count": c.first_k_dense_replace,
        "vocab_size": c.vocab_size,
        "attention.kv_lora_rank": c.kv_lora_rank,
        "expert_count": c.n_routed_experts,
        "expert_shared_count": c.n_shared_experts,
        "expert_weights_scale": float(c.routed_scaling_factor),
        "rope.dimension_count": c.qk_rope_head_dim,
        "expert_group_count": c.n_group,
        "expert_group_used_count": c.topk_group,
    }
    if c.q_lora_rank:
        meta["attention.q_lora_rank"] = c.q_lora_rank
    if split_kv_b:
        meta["attention.key_length"] = c.kv_lora_rank + c.qk_rope_head_dim
        meta["attention.value_length"] = c.kv_lora_rank
        meta["attention.key_length_mla"] = c.qk_nope_head_dim + c.qk_rope_head_dim
        meta["attention.value_length_mla"] = c.v_head_dim
    else:  # files converted before llama.cpp split kv_b_proj
        meta["attention.key_length"] = c.qk_nope_head_dim + c.qk_rope_head_dim
        meta["attention.value_length"] = c.v_head_dim
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":  # TextModel writes the scaling, DeepseekV2Model the log multiplier
        meta["rope.scaling.type"] = "yarn"
        meta["rope.scaling.factor"] = float(rope["factor"])
        meta["rope.scaling.original_context_length"] = rope["original_max_position_embeddings"]
        meta["rope.scaling.yarn_log_multiplier"] = 0.1 * rope["mscale_all_dim"]
    if c.model_type == "deepseek_v3":
        meta["expert_gating_func"] = 2  # sigmoid
        if c.norm_topk_prob:
            meta["expert_weights_norm"] = True
    return meta


def _partial_rotary_metadata(c: Any, arch: str) -> dict[str, Any]:
    """GLM-4-MoE's (conversion/glm.py Glm4MoeModel) and MiniMax-M2's (conversion/minimax.py) keys."""
    rotary = int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 1.0))
    meta = _text_model_metadata(c) | {
        "attention.key_length": c.head_dim,
        "attention.value_length": c.head_dim,
        "rope.dimension_count": rotary,
        "expert_gating_func": 2,  # sigmoid
    }
    if arch == "minimax-m2":
        return meta | {"expert_count": c.num_local_experts, "expert_feed_forward_length": c.intermediate_size}
    return meta | {
        "expert_count": c.n_routed_experts,
        "expert_feed_forward_length": c.moe_intermediate_size,
        "expert_shared_count": c.n_shared_experts,
        "leading_dense_block_count": c.first_k_dense_replace,
        "expert_weights_scale": float(c.routed_scaling_factor),
        "expert_weights_norm": bool(c.norm_topk_prob),
        "expert_group_count": c.n_group,
        "expert_group_used_count": c.topk_group,
    }


def _hf_tensors(model: torch.nn.Module, split_kv_b: bool) -> list[tuple[str, torch.Tensor]]:
    """(transformers module name + suffix, tensor) as the converter sees them: experts unfused and
    stacked per projection, kv_b_proj split and k_b transposed, e_score_correction_bias renamed."""
    config = model.config
    out: list[tuple[str, torch.Tensor]] = []
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if config.model_type == "gpt_oss" and ".mlp.experts." in name:
            # conversion/gpt_oss.py: gate_up [E, H, 2I] transposed and de-interleaved (gate even
            # rows, up odd), down [E, I, H] transposed, the biases split the same way
            stem = name[: name.index("experts.") + len("experts.")]
            if name.endswith("gate_up_proj"):
                t = t.transpose(1, 2)
                out += [(stem + "gate_proj.weight", t[:, 0::2]), (stem + "up_proj.weight", t[:, 1::2])]
            elif name.endswith("gate_up_proj_bias"):
                out += [(stem + "gate_proj.bias", t[:, 0::2]), (stem + "up_proj.bias", t[:, 1::2])]
            elif name.endswith("down_proj"):
                out.append((stem + "down_proj.weight", t.transpose(1, 2)))
            else:
                out.append((stem + "down_proj.bias", t))
        elif config.model_type == "qwen3_next" and not name.startswith("lm_head") and ".experts." not in name:
            out += _qwen3next_tensors(config, name, t)
        elif name.endswith("self_attn.sinks"):
            out.append((name + ".weight", t))  # GptOssModel.filter_tensors
        elif config.model_type == "mixtral" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            out.append((name, _llama_permute(t, heads)))
        elif name.endswith("mlp.experts.gate_up_proj"):
            inter = t.shape[1] // 2
            stem = name.removesuffix("gate_up_proj")
            out += [(stem + "gate_proj.weight", t[:, :inter]), (stem + "up_proj.weight", t[:, inter:])]
        elif name.endswith("mlp.experts.down_proj"):
            out.append((name + ".weight", t))
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope, value = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
            kv_b = t.view(heads, nope + value, t.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, value], dim=1)
            out += [(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)), (name.replace("kv_b", "v_b"), v_b)]
        elif name.endswith("e_score_correction_bias"):
            out.append((name.replace("e_score_correction_bias", "e_score_correction.bias"), t))
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        else:
            out.append((name, t))
    return out


def _qwen3next_tensors(config: Any, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """conversion/qwen.py's Qwen3NextModel.modify_tensors: ``1 + w`` norms (not the delta-net's gated
    norm), ``-exp(A_log)``, dt_bias renamed, the conv weight squeezed, and in_proj_qkvz out of its
    per-key-head groups [q k v z] into attn_qkv (all q, all k, all v) and attn_gate (z). Names that
    have no transformers module are given as ``gguf:`` + the GGUF name."""
    if name.endswith(".A_log"):
        return [("gguf:" + _blk(name) + "ssm_a", -torch.exp(t))]
    if name.endswith(".dt_bias"):
        return [(name.removesuffix("dt_bias") + "dt_proj.bias", t)]
    if "conv1d" in name:
        return [(name, t.squeeze())]
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return [(name, t + 1)]
    if name.endswith("in_proj_qkvz.weight"):
        c = config
        dk, dv = c.linear_key_head_dim, c.linear_num_value_heads // c.linear_num_key_heads * c.linear_value_head_dim
        groups = t.permute(1, 0).reshape(c.hidden_size, c.linear_num_key_heads, 2 * dk + 2 * dv)
        q, k, v, z = torch.split(groups, [dk, dk, dv, dv], dim=-1)
        flat = [x.reshape(c.hidden_size, -1) for x in (q, k, v, z)]
        qkv = torch.cat(flat[:3], dim=-1).permute(1, 0).contiguous()
        return [("gguf:" + _blk(name) + "attn_qkv.weight", qkv), ("gguf:" + _blk(name) + "attn_gate.weight", flat[3].T)]
    return [(name, t)]


def _blk(name: str) -> str:
    return f"blk.{name.split('.')[2]}."


def _qwen3next_state(config: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """_qwen3next_tensors undone on what the file holds, as transformers' state dict names it."""
    out: dict[str, torch.Tensor] = {}
    c = config
    for name, t in state.items():
        if name.startswith("gguf:"):
            layer = name.split(".")[1]
            stem = f"model.layers.{layer}.linear_attn."
            if name.endswith("ssm_a"):
                out[stem + "A_log"] = torch.log(-t)
            elif name.endswith("attn_qkv.weight"):
                dk = c.linear_key_head_dim
                dv = c.linear_num_value_heads // c.linear_num_key_heads * c.linear_value_head_dim
                g, h = c.linear_num_key_heads, c.hidden_size
                z = state[name.replace("attn_qkv", "attn_gate")]
                q, k, v = t[: g * dk], t[g * dk : 2 * g * dk], t[2 * g * dk :]
                parts = [q.view(g, dk, h), k.view(g, dk, h), v.view(g, dv, h), z.view(g, dv, h)]
                out[stem + "in_proj_qkvz.weight"] = torch.cat(parts, dim=1).reshape(-1, h)
        elif name.endswith("dt_proj.bias"):
            out[name.removesuffix("dt_proj.bias") + "dt_bias"] = t
        elif "conv1d" in name:
            out[name] = t.unsqueeze(1)
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            out[name] = t - 1
        else:
            out[name] = t
    return out


def _llama_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's ``LlamaModel.permute`` (q and k rows for ggml's interleaved rope)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _ggml_type(gguf_name: str, t: torch.Tensor, moe_index: dict[int, int], expert_types: list) -> Any:
    parts = gguf_name.split(".")
    leaf = parts[-2] if len(parts) >= 2 else parts[0]
    if t.dim() == 1 or leaf.endswith("_norm") or parts[-1] == "bias":
        return Q.F32
    if leaf.endswith("_exps"):
        types = expert_types[moe_index[int(parts[1])] % len(expert_types)]
        return types[("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps").index(leaf)]
    if leaf in LEAF_TYPES:
        return LEAF_TYPES[leaf]
    return Q.Q8_0 if t.shape[-1] % 32 == 0 else Q.F16


def write_gguf(
    model: torch.nn.Module,
    path: Path,
    *,
    split_kv_b: bool = True,
    drop_tensors: tuple[str, ...] = (),
    drop_keys: tuple[str, ...] = (),
    extra_keys: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    arch: str | None = None,
    tokenizer_dir: Path | None = None,
) -> dict[str, torch.Tensor]:
    """Write ``model`` as a GGUF file; return the transformers state dict of what the file holds,
    each tensor ``gguf.quants.dequantize`` of the bytes written (experts fused back as transformers
    keeps them, kv_b_proj unsplit)."""
    config = model.config
    arch = arch or ARCH[config.model_type]
    enum = ARCH_ENUM.get(ARCH[config.model_type], ARCH[config.model_type].upper())
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[enum], config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (_metadata(config, ARCH[config.model_type], split_kv_b) | (extra_keys or {})).items():
        if key in drop_keys:
            continue
        full = f"{arch}.{key}"
        if isinstance(value, list):
            writer.add_array(full, value)
        elif isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, bool):
            writer.add_bool(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        else:
            writer.add_float32(full, value)
    if tokenizer_dir is not None:
        _add_tokenizer(writer, tokenizer_dir)
    moe_layers = sorted({int(n.split(".")[2]) for n, _ in model.named_parameters() if ".experts." in n})
    moe_index = {layer: i for i, layer in enumerate(moe_layers)}
    state: dict[str, torch.Tensor] = {}
    for hf_name, t in _hf_tensors(model, split_kv_b):
        if hf_name.startswith("gguf:"):
            gguf_name = hf_name.removeprefix("gguf:")
        else:
            module, suffix = hf_name.rsplit(".", 1)
            mapped = names.get_name(module)
            assert mapped is not None, f"the gguf package has no llama.cpp name for {module}"
            gguf_name = f"{mapped}.{suffix}"
        shape = t.shape
        if module.endswith("shared_expert_gate"):
            t = t.reshape(-1)  # llama.cpp declares ffn_gate_inp_shexp as {n_embd}
        expert_types = GPT_OSS_EXPERT_TYPES if config.model_type == "gpt_oss" else EXPERT_TYPES
        qtype = _ggml_type(gguf_name, t, moe_index, expert_types)
        data = quantize(t.numpy(), qtype)
        back = torch.from_numpy(np.ascontiguousarray(dequantize(data, qtype))).float().reshape(shape)
        if gguf_name not in drop_tensors:
            if qtype in (Q.F32, Q.F16):
                writer.add_tensor(gguf_name, data)
            else:
                writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        state[hf_name] = back
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return _transformers_state(model, state)


def _transformers_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The converter-side names back to transformers' state dict (what the reference model loads)."""
    config = model.config
    if config.model_type == "qwen3_next":
        state = _qwen3next_state(config, state)
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if config.model_type == "gpt_oss" and ".mlp.experts." in name:
            stem = name[: name.index("experts.") + len("experts.")]
            if name.endswith("gate_proj.weight") or name.endswith("gate_proj.bias"):
                kind = name.rsplit(".", 1)[1]
                up = state[stem + "up_proj." + kind]
                fused = torch.stack([t, up], dim=2).flatten(1, 2)  # gate and up rows interleaved again
                key = "gate_up_proj" if kind == "weight" else "gate_up_proj_bias"
                out[stem + key] = fused.transpose(1, 2).contiguous() if kind == "weight" else fused
            elif name.endswith("down_proj.weight"):
                out[stem + "down_proj"] = t.transpose(1, 2).contiguous()
            elif name.endswith("down_proj.bias"):
                out[stem + "down_proj_bias"] = t
        elif name.endswith("self_attn.sinks.weight"):
            out[name.removesuffix(".weight")] = t
        elif config.model_type == "mixtral" and name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            out[name] = _llama_unpermute(t, heads)
        elif name.endswith(".mlp.experts.gate_proj.weight"):
            stem = name.removesuffix("gate_proj.weight")
            out[stem + "gate_up_proj"] = torch.cat([t, state[stem + "up_proj.weight"]], dim=1)
        elif name.endswith(".mlp.experts.down_proj.weight"):
            out[name.removesuffix(".weight")] = t
        elif name.endswith(".mlp.experts.up_proj.weight"):
            continue
        elif name.endswith(".k_b_proj.weight"):
            heads, nope, value = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
            v_b = state[name.replace("k_b_proj", "v_b_proj")]
            joined = torch.cat([t.transpose(1, 2), v_b], dim=1).reshape(heads * (nope + value), -1)
            out[name.replace("k_b_proj", "kv_b_proj")] = joined
        elif name.endswith(".v_b_proj.weight"):
            continue
        elif name.endswith("e_score_correction.bias"):
            out[name.replace("e_score_correction.bias", "e_score_correction_bias")] = t
        else:
            out[name] = t
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def reference(model: torch.nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    """transformers' model of the same config running exactly the weights in the file."""
    ref = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    ref.load_state_dict(state, strict=True)
    return ref.to(dtype).eval()


def _add_tokenizer(writer: Any, directory: Path) -> None:
    """The byte-level BPE of ``directory`` as llama.cpp's ``_set_vocab_gpt2`` writes it."""
    tj = json.loads((directory / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    control = {a["id"] for a in tj["added_tokens"] if a["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # the GPT-2 split regex, as this tokenizer's ByteLevel(use_regex) uses
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in control else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab.get(settings["eos_token"], 2) if "eos_token" in settings else 2)
    writer.add_pad_token_id(0)
    if settings.get("chat_template"):
        writer.add_chat_template(settings["chat_template"])


# --- logits -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "overrides", "split_kv_b"),
    [
        ("qwen3_moe", {}, True),
        ("qwen3_moe", {"tie_word_embeddings": True}, True),
        ("qwen2_moe", {}, True),
        ("deepseek_v3", {}, True),
        ("deepseek_v3", {"q_lora_rank": None}, False),
        ("deepseek_v2", {"n_group": 1, "topk_group": 1}, True),
        ("deepseek_v3", {"rope_parameters": YARN}, True),
        ("glm4_moe", {}, True),
        ("glm4_moe", {"use_qk_norm": True, "attention_bias": True, "norm_topk_prob": False}, True),
        ("minimax_m2", {"rope_parameters": HALF_ROTARY}, True),
        ("olmoe", {"num_key_value_heads": 4, "rms_norm_eps": 1e-5}, True),  # llama.cpp: as many KV heads as heads
    ],
    ids=[
        "qwen3moe",
        "qwen3moe-tied",
        "qwen2moe",
        "deepseek2-v3",
        "deepseek2-v3-lite-kv_b",
        "deepseek2-v2",
        "yarn",
        "glm4moe",
        "glm4moe-qk-norm-bias",
        "minimax-m2",
        "olmoe",
    ],
)
@ONE_ARITHMETIC
def test_gguf_logits_match_transformers(model_type: str, overrides: dict, split_kv_b: bool, tmp_path: Path) -> None:
    model = random_model(model_type, **overrides)
    path = tmp_path / "model.gguf"
    state = write_gguf(model, path, split_kv_b=split_kv_b)
    ids = tokens()
    want32 = logits(reference(model, state, torch.float32), ids)

    ours = load_model(path, device="cpu", dtype=torch.float32)
    assert ours.config.model_type == model_type
    assert not [n for n, _ in ours.named_parameters() if ".experts." in n]  # experts only in the engine
    runtime = ours.hetmoe
    assert {runtime.layers[layer].cpu.gate.method for layer in runtime.layers} == {"gguf:q8_0", "gguf:q4_0"}
    assert rel(logits(ours, ids), want32) <= 5e-5
    # The experts on the torch fallback dequantize exactly: everything else is transformers' own math.
    # the dense layers too ran in the engine from their stored blocks (dense_engine.py's STORED)
    o_proj = ours.model.layers[0].self_attn.o_proj  # attn_output is Q8_0 in these files
    assert isinstance(o_proj, CPULinear) and o_proj.method == "gguf:q8_0"
    # The experts on the torch fallback and torch dense layers dequantize exactly: everything else is
    # transformers' own math.
    exact = load_model(path, device="cpu", dtype=torch.float32, expert_backend="torch", dense_method="torch")
    assert rel(logits(exact, ids), want32) <= 1e-6

    ours16 = load_model(path, device="cpu")  # the default: the model in bf16
    assert ours16.dtype == torch.bfloat16
    theirs16 = rel(logits(reference(model, state, torch.bfloat16), ids), want32)
    got16 = rel(logits(ours16, ids), want32)
    assert got16 <= 1.25 * theirs16 + 2**-8, (got16, theirs16)


@ONE_ARITHMETIC
def test_qwen3next_gguf_logits_match_transformers(tmp_path: Path) -> None:
    """Qwen3-Next as conversion/qwen.py writes it (its transforms undone by the reader): a delta-net
    layer and a full-attention layer by ``attention.recurrent_layers`` (the file's interval of 4 says
    otherwise and loses), q/k norms, partial rotary, a gated shared expert. The same bounds as the
    other architectures (module docstring); the delta-net runs transformers' torch code in both."""
    model = random_model("qwen3_next")
    path = tmp_path / "model.gguf"
    state = write_gguf(model, path)
    ids = tokens()
    want32 = logits(reference(model, state, torch.float32), ids)
    ours = load_model(path, device="cpu", dtype=torch.float32)
    got, want = ours.config, model.config
    fields = [
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "layer_types",
    ]
    assert got.model_type == "qwen3_next"
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.rope_parameters["partial_rotary_factor"] == want.rope_parameters["partial_rotary_factor"]
    # in_proj_qkvz runs from the Q8_0 blocks of attn_qkv and attn_gate, their rows put back in order
    qkvz = ours.model.layers[0].linear_attn.in_proj_qkvz
    assert isinstance(qkvz, CPULinear) and qkvz.method == "gguf:q8_0"
    assert rel(logits(ours, ids), want32) <= 5e-5
    exact = load_model(path, device="cpu", dtype=torch.float32, expert_backend="torch", dense_method="torch")
    assert rel(logits(exact, ids), want32) <= 1e-6
    ours16 = load_model(path, device="cpu")
    theirs16 = rel(logits(reference(model, state, torch.bfloat16), ids), want32)
    got16 = rel(logits(ours16, ids), want32)
    assert got16 <= 1.25 * theirs16 + 2**-8, (got16, theirs16)
    # A file without the per-layer flags: every full_attention_interval-th layer is full attention.
    older = tmp_path / "interval.gguf"
    write_gguf(model, older, drop_keys=("attention.recurrent_layers",), extra_keys={"full_attention_interval": 2})
    assert load_model(older, dtype=torch.float32).config.layer_types == ["linear_attention", "full_attention"]


@ONE_ARITHMETIC
def test_gpt_oss_gguf_logits_match_transformers(tmp_path: Path) -> None:
    """gpt-oss as llama.cpp's converter writes it: MXFP4 experts (one layer's up projection Q8_0) with
    their biases, the router's bias, biased attention with a sink per head, sliding-window (16) and full
    layers. A 24-token prompt runs past the window. The MXFP4 experts run in the engine as stored (the
    mxfp4 kernels, their nibbles reordered: exact), against transformers' forward of the weights in
    the file (YaRN as ggml computes it: transformers' truncated correction range)."""
    # gpt-oss's YaRN with ggml's correction range: floored and ceiled (truncate, transformers' default;
    # the released config.json says truncate false, which llama.cpp does not read)
    rope = tiny_config("gpt_oss").rope_parameters | {"truncate": True}
    model = random_model("gpt_oss", rope_parameters=rope)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # transformers starts biases at zero and sinks near it: give them weight
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("bias") and ".experts." not in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    path = tmp_path / "model.gguf"
    state = write_gguf(model, path)
    ids = tokens(shape=(2, 24))
    want32 = logits(reference(model, state, torch.float32), ids)

    ours = load_model(path, device="cpu", dtype=torch.float32)
    assert ours.config.model_type == "gpt_oss"
    assert ours.config.layer_types == model.config.layer_types and ours.config.sliding_window == 16
    methods = {m for layer in ours.hetmoe.layers.values() for m in (layer.cpu.gate.method, layer.cpu.up.method)}
    assert methods == {"gguf:mxfp4", "gguf:q8_0"}, methods
    # MXFP4 runs as the engine's own mxfp4, no int8 detour
    notes = {n.split(": ", 1)[1] for layer in ours.hetmoe.layers.values() for n in layer.cpu.notes}
    assert notes == {"MXFP4 -> mxfp4 (exact)"}, notes
    # int16-level activations in the engine's expert and dense kernels (5e-5, as for the other families)
    assert rel(logits(ours, ids), want32) <= 5e-5
    exact = load_model(path, device="cpu", dtype=torch.float32, expert_backend="torch", dense_method="torch")
    assert rel(logits(exact, ids), want32) <= 1e-6  # the file's values, transformers' own math

    ours16 = load_model(path, device="cpu")
    theirs16 = rel(logits(reference(model, state, torch.bfloat16), ids), want32)
    got16 = rel(logits(ours16, ids), want32)
    assert got16 <= 1.25 * theirs16 + 2**-8, (got16, theirs16)


@ONE_ARITHMETIC
@pytest.mark.parametrize("qk_type", ["F16", "Q8_0"])
def test_mixtral_gguf_logits_match_transformers(qk_type: str, monkeypatch, tmp_path: Path) -> None:
    """Mixtral as llama.cpp files it (arch llama with experts): q and k rows permuted by the converter
    for ggml's interleaved rope are put back in transformers' order, decoded (F16, which an fp32 load
    keeps in torch) or as their stored blocks (Q8_0, whole rows moved: the engine runs them as stored);
    logits against transformers' forward of the weights in the file."""
    monkeypatch.setitem(LEAF_TYPES, "attn_q", getattr(Q, qk_type))
    monkeypatch.setitem(LEAF_TYPES, "attn_k", getattr(Q, qk_type))
    model = random_model("mixtral")
    path = tmp_path / "model.gguf"
    state = write_gguf(model, path)
    ids = tokens()
    want32 = logits(reference(model, state, torch.float32), ids)
    ours = load_model(path, device="cpu", dtype=torch.float32)
    assert ours.config.model_type == "mixtral"
    if qk_type == "Q8_0":  # q, k and v share Q8_0: one fused engine linear over the moved rows
        assert ours.model.layers[0].self_attn.fused_qkv_proj.linear.method == "gguf:q8_0"
    assert rel(logits(ours, ids), want32) <= 5e-5  # the engine's int16-level activations, as for the others
    exact = load_model(path, device="cpu", dtype=torch.float32, expert_backend="torch", dense_method="torch")
    assert rel(logits(exact, ids), want32) <= 1e-6


def test_gpt_oss_sliding_pattern_from_metadata(tmp_path: Path) -> None:
    """llama.cpp's ``attention.sliding_window_pattern``: per-layer flags, or every n-th layer full."""
    model = random_model("gpt_oss")
    path = tmp_path / "flags.gguf"
    write_gguf(model, path, extra_keys={"attention.sliding_window_pattern": 0})
    assert load_model(path, device="cpu").config.layer_types == ["sliding_attention"] * 2
    path = tmp_path / "bad.gguf"
    write_gguf(model, path, extra_keys={"rope.freq_base_swa": 1234.0})
    with pytest.raises(CheckpointError, match="freq_base_swa"):
        load_model(path, device="cpu")


@ONE_ARITHMETIC
def test_glm4moe_prediction_block_is_left_unread(tmp_path: Path) -> None:
    """GLM-4-MoE files carry their multi-token-prediction block after the decoder layers, counted in
    block_count and named by nextn_predict_layers (convert_hf_to_gguf's Glm4MoeModel): the model is
    the layers before it, with the logits of the file without it."""
    model = random_model("glm4_moe")
    n = model.config.num_hidden_layers
    hidden, experts, inter = model.config.hidden_size, model.config.n_routed_experts, model.config.moe_intermediate_size
    gen = torch.Generator().manual_seed(7)
    mtp = {  # a few of the block's tensors: its own norms, projection and experts
        f"blk.{n}.attn_norm.weight": torch.ones(hidden).numpy(),
        f"blk.{n}.nextn.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen).numpy(),
        f"blk.{n}.nextn.enorm.weight": torch.ones(hidden).numpy(),
        f"blk.{n}.ffn_up_exps.weight": torch.randn(experts, inter, hidden, generator=gen).numpy(),
    }
    path = tmp_path / "mtp.gguf"
    state = write_gguf(model, path, extra_keys={"block_count": n + 1, "nextn_predict_layers": 1}, extra_tensors=mtp)
    ours = load_model(path, device="cpu", dtype=torch.float32)
    assert ours.config.num_hidden_layers == n and sorted(ours.hetmoe.layers) == list(range(1, n))
    ids = tokens()
    assert rel(logits(ours, ids), logits(reference(model, state, torch.float32), ids)) <= 5e-5


def test_config_from_metadata_matches_the_model(tmp_path: Path) -> None:
    """The transformers config rebuilt from the metadata has every size of the original."""
    model = random_model("deepseek_v3")
    path = tmp_path / "m.gguf"
    write_gguf(model, path)
    got = load_model(path, dtype=torch.float32).config
    want = model.config
    fields = [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "first_k_dense_replace",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "max_position_embeddings",
        "tie_word_embeddings",
    ]
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps, rel=1e-7)  # GGUF stores it as float32


@pytest.mark.parametrize(
    ("model_type", "split_kv_b"),
    [("qwen3_moe", True), ("deepseek_v3", True), ("deepseek_v3", False), ("qwen3_next", True)],
)
def test_memory_plan_counts_the_kv_cache_transformers_keeps(model_type: str, split_kv_b: bool, tmp_path: Path) -> None:
    """The planner's KV bytes per token for a GGUF file equal those of the original config (they took
    one head of the whole hidden width when the metadata's head counts were not read)."""
    model = random_model(model_type)
    path = tmp_path / "m.gguf"
    write_gguf(model, path, split_kv_b=split_kv_b)
    plan = plan_memory(path)
    want, _ = kv_bytes_per_token(model.config.to_dict(), plan.dtype_bytes)
    assert plan.kv_bytes_per_token == want


# --- errors -------------------------------------------------------------------------------------


def test_missing_tensor_names_the_file_and_key(tmp_path: Path) -> None:
    model = random_model("qwen3_moe")
    path = tmp_path / "m.gguf"
    write_gguf(model, path, drop_tensors=("blk.1.attn_k_norm.weight",))
    with pytest.raises(CheckpointError, match=r"m\.gguf: missing tensor blk\.1\.attn_k_norm\.weight"):
        load_model(path)


def test_missing_metadata_names_the_file_and_key(tmp_path: Path) -> None:
    model = random_model("qwen3_moe")
    path = tmp_path / "m.gguf"
    write_gguf(model, path, drop_keys=("attention.head_count",))
    with pytest.raises(CheckpointError, match=r"m\.gguf: GGUF metadata lacks qwen3moe\.attention\.head_count"):
        load_model(path)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    model = random_model("qwen3_moe")
    path = tmp_path / "m.gguf"
    write_gguf(model, path, arch="bailingmoe")
    with pytest.raises(CheckpointError, match=r"m\.gguf: general\.architecture 'bailingmoe'.*qwen3moe"):
        load_model(path)


def test_dense_llama_file_is_named_a_dense_model(tmp_path: Path) -> None:
    """llama.cpp files Mixtral as llama with experts; a llama file without them is a dense model."""
    path = tmp_path / "dense.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "embedding_length": 64, "attention.head_count": 4}.items():
        writer.add_uint32(f"llama.{key}", value)
    for name, shape in {"token_embd.weight": (128, 64), "blk.0.ffn_up.weight": (128, 64)}.items():
        writer.add_tensor(name, np.zeros(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"dense\.gguf: general\.architecture 'llama' without routed-expert"):
        load_model(path)


def test_tensor_without_a_place_in_the_model_is_an_error(tmp_path: Path) -> None:
    model = random_model("qwen3_moe")
    path = tmp_path / "m.gguf"
    write_gguf(model, path, extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)})
    with pytest.raises(CheckpointError, match=r"m\.gguf: 1 tensors have no place.*blk\.0\.attn_sinks\.weight"):
        load_model(path)


# --- tokenizer and the CLI ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_gguf(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], torch.nn.Module]:
    """The embedded default model (a 4-layer Qwen3-MoE with its own byte-level BPE) as a GGUF file with
    its tokenizer in the metadata and no tokenizer files beside it."""
    source = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    path = tmp_path_factory.mktemp("default-gguf") / "default.gguf"
    state = write_gguf(model, path, tokenizer_dir=source)
    return path, state, model


def test_tokenizer_from_gguf_metadata_round_trips(default_gguf) -> None:
    path, _, _ = default_gguf
    ours = load_gguf_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(default_model_path()))
    text = (default_model_path() / "heldout.txt").read_text()[:4000]
    text += " <|im_start|>user\nhéllo wörld 12345  \t x<|im_end|>"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.decode(ours(text)["input_ids"]) == text
    assert ours.convert_tokens_to_ids("<|im_start|>") == 1 and ours.eos_token == "<|im_end|>"
    assert ours.chat_template == theirs.chat_template


def test_tokenizer_files_beside_the_gguf_are_preferred(default_gguf, tmp_path: Path) -> None:
    path, _, _ = default_gguf
    local = tmp_path / "model.gguf"
    shutil.copy(path, local)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path() / name, tmp_path / name)
    tok = load_gguf_tokenizer(local)
    assert tok.name_or_path == str(tmp_path)
    assert (
        tok("def f(x):")["input_ids"]
        == AutoTokenizer.from_pretrained(str(default_model_path()))("def f(x):")["input_ids"]
    )


def test_generate_cli_runs_a_gguf_file(default_gguf, capsys) -> None:
    path, state, model = default_gguf
    prompt = "def fibonacci(n):"
    argv = ["generate", str(path), prompt, "--max-new-tokens", "8", "--dtype", "float32", "--threads", "1"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "routed experts gguf:" in err
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    ref = reference(model, state, torch.float32)
    want = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.rstrip("\n") == tok.decode(want[0, ids.shape[1] :], skip_special_tokens=True)


def test_serve_answers_from_a_gguf_file(default_gguf) -> None:
    """`hetmoe serve model.gguf`: named after the file, the tokenizer from its metadata, and a greedy
    chat completion equal to transformers' generate on the weights the file holds."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from hetmoe.cli.serve import resolve_model
    from hetmoe.serve.app import build_app
    from hetmoe.serve.background import BackgroundServer
    from hetmoe.serve.served_model import load_served_model

    path, state, model = default_gguf
    resolved, name = resolve_model(str(path))
    assert (resolved, name) == (path, "default")
    served = load_served_model(path, name=name, threads=1, dtype="float32")
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    tok = AutoTokenizer.from_pretrained(str(default_model_path()))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert served.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == prompt
    ids = torch.tensor([prompt])
    want = reference(model, state, torch.float32).generate(
        ids, max_new_tokens=8, do_sample=False, eos_token_id=[], pad_token_id=tok.pad_token_id
    )
    with BackgroundServer(build_app(served)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["default"]
        reply = client.chat.completions.create(
            model="default", messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
    assert reply.choices[0].message.content == tok.decode(want[0, ids.shape[1] :], skip_special_tokens=True)


def test_eval_ppl_runs_a_gguf_file(default_gguf, tmp_path: Path, capsys) -> None:
    """`hetmoe eval ppl model.gguf`: the file's experts as stored against the same file converted to bf16."""
    path, _, _ = default_gguf
    text = tmp_path / "text.txt"
    text.write_text((default_model_path() / "heldout.txt").read_text()[:1500])
    out = tmp_path / "q.json"
    argv = ["eval", "ppl", str(path), "--text", str(text), "--methods", "bf16,gguf:q8_0", "--context", "64"]
    assert main([*argv, "--max-windows", "2", "--threads", "1", "--dtype", "float32", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["bf16"]["error"] is None and rows["gguf:q8_0"]["error"] is None
    assert rows["bf16"]["kl_mean"] == 0.0 and 0.0 < rows["gguf:q8_0"]["kl_mean"] < 0.05
    capsys.readouterr()


def test_deepseek2_without_gating_func_is_softmax_as_llama_cpp(tmp_path: Path) -> None:
    """A DeepSeek-V3 model converted without ``expert_gating_func`` (what convert_hf_to_gguf writes for
    transformers 5's config): llama.cpp runs it with softmax gating, its selection bias still added to
    the selection scores, the top-k weights renormalised (expert_weights_norm) and scaled. hetmoe runs
    it the same way and says so in a note, instead of refusing the file."""
    model = random_model("deepseek_v3", norm_topk_prob=True, n_group=1, topk_group=1, routed_scaling_factor=2.5)
    path = tmp_path / "model.gguf"
    write_gguf(model, path, drop_keys=("expert_gating_func",))
    ours = load_model(path, device="cpu", dtype=torch.float32)
    assert ours.config.model_type == "deepseek_v3" and ours.config.scoring_func == "softmax"
    assert any("expert_gating_func" in note and "softmax" in note for note in ours.hetmoe.notes)
    layer = ours.hetmoe.layers[min(ours.hetmoe.layers)]
    x = torch.randn(5, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    weights, ids = layer.adapter.route(layer, x)
    # llama.cpp's build_moe_ffn: probs = softmax(logits); choice = top-k of probs + exp_probs_b;
    # weights = probs of the chosen, divided by their sum, times expert_weights_scale
    probs = torch.softmax(x @ layer.gate.weight.float().T, dim=-1)
    want_ids = (probs + layer.gate.e_score_correction_bias).topk(ids.shape[1]).indices
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    want = probs.gather(1, ids)
    want = want / want.sum(-1, keepdim=True) * 2.5
    assert torch.allclose(weights, want, rtol=1e-6, atol=0)


# --- MLA's per-head products on the file's attn_k_b / attn_v_b -------------------------------------


@ONE_ARITHMETIC
def test_deepseek2_decode_reads_attn_k_b_and_v_b_as_stored(tmp_path: Path, monkeypatch) -> None:
    """A deepseek2 file with kv_b_proj split (attn_k_b, attn_v_b in Q8_0 here, as llama.cpp's converter
    writes it and its quantizer types it): the default bf16 load gives each latent-attention layer the
    file's blocks for the decode step's W_UK^T and W_UV (mla_decode.attach_stored_heads), every decode
    step takes the one-call block, and 12 greedy steps' logits stay within the bf16 load's bound of
    transformers' fp32 forward over the same tokens and the file's weights (as
    test_gguf_logits_match_transformers: 1.25 x the error of transformers' own bf16 model + 2^-8).
    Without the stored blocks the same steps read kv_b_proj's bf16 weight (each value rounded to 8
    bits); the stored ones are the file's exact values against int16-level activations."""
    import hetmoe.models.fast_decode as fast_decode

    widths = {"kv_lora_rank": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "qk_rope_head_dim": 16, "head_dim": 16}
    widths["num_key_value_heads"] = 4  # = the heads, as DeepSeek configs have it (latent K/V: one per head)
    model = random_model("deepseek_v3", **widths)
    path = tmp_path / "model.gguf"
    state = write_gguf(model, path, split_kv_b=True)
    ours = load_model(path, device="cpu")
    assert ours.dtype == torch.bfloat16
    for layer in ours.model.layers:
        assert layer.self_attn._hetmoe_stored_heads.label == "attn_k_b gguf:q8_0, attn_v_b gguf:q8_0"
    assert any("decode per head on the file's attn_k_b gguf:q8_0" in line for line in ours.hetmoe.layer_paths)
    taken = spy_taken(monkeypatch, fast_decode, "one_token_mla")
    ids = tokens(shape=(1, 6))
    steps, seq = [], ids
    with torch.inference_mode():
        cache = growing_cache(ours.config)
        out = ours(ids, cache=cache, use_cache=True)
        for _ in range(12):
            nxt = out.logits[:, -1:].argmax(-1)
            seq = torch.cat((seq, nxt), dim=1)
            out = ours(nxt, cache=cache, use_cache=True)
            steps.append(out.logits[:, -1].float())
    assert len(taken) == 12 * ours.config.num_hidden_layers and all(taken)
    # transformers' decoder layers around the absorbed forward (its one-token branch) read the same
    # blocks with the same kernels: the same logits, bit for bit
    monkeypatch.undo()
    modules = [ours, *ours.model.layers]
    forwards = [vars(m).pop("forward", None) for m in modules]
    try:
        with torch.inference_mode():
            cache = growing_cache(ours.config)
            ours(ids, cache=cache, use_cache=True)
            for i, step in enumerate(steps):
                out = ours(seq[:, ids.shape[1] + i : ids.shape[1] + i + 1], cache=cache, use_cache=True)
                assert torch.equal(out.logits[:, -1].float(), step), i
    finally:
        for m, forward in zip(modules, forwards, strict=True):
            if forward is not None:
                m.forward = forward
    got = torch.cat(steps)
    at = slice(ids.shape[1], seq.shape[1])  # the positions the steps' logits belong to
    want32 = logits(reference(model, state, torch.float32), seq)[0, at]
    theirs16 = rel(logits(reference(model, state, torch.bfloat16), seq)[0, at], want32)
    assert rel(got, want32) <= 1.25 * theirs16 + 2**-8, (rel(got, want32), theirs16)


# --- the token embedding stays in its blocks -------------------------------------------------------


def test_embedding_stays_in_its_blocks_and_decodes_the_rows_looked_up(tmp_path: Path) -> None:
    """A GGUF's token embedding is not decoded into a float table: the model looks rows up in the
    stored blocks (the file's mapped bytes), each row bit-identical to gguf.quants.dequantize's."""
    path = tmp_path / "model.gguf"
    state = write_gguf(random_model("qwen3_moe"), path)  # token_embd in Q8_0 (_ggml_type)
    want = state["model.embed_tokens.weight"]
    ids = tokens()
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype=dtype)
        table = model.get_input_embeddings()
        assert isinstance(table, StoredEmbedding) and table.method == "gguf:q8_0"
        assert not any(p.shape == want.shape for p in model.parameters())  # no decoded copy anywhere
        assert torch.equal(table(ids), want[ids].to(dtype))
    with pytest.raises(IndexError, match=f"token id {want.shape[0]} is outside the embedding's {want.shape[0]} rows"):
        table(torch.tensor([[3, want.shape[0]]]))
    # tied to the lm_head, the table is a weight the lm_head reads whole: it stays an nn.Embedding
    tied = tmp_path / "tied.gguf"
    write_gguf(random_model("qwen3_moe", tie_word_embeddings=True), tied)
    assert type(load_model(tied).get_input_embeddings()) is torch.nn.Embedding


def test_gguf_load_reads_every_expert_tensor_ahead_once(tmp_path: Path, monkeypatch) -> None:
    """load_model reads each MoE layer's expert tensors into the page cache one layer ahead
    (GGUFFile.prefetch), every one of them once."""
    from hetmoe.checkpoint import gguf_file

    fetched: list[str] = []
    monkeypatch.setattr(gguf_file.GGUFFile, "prefetch", lambda self, name: fetched.append(name))
    path = tmp_path / "model.gguf"
    write_gguf(random_model("qwen3_moe"), path)
    load_model(path)
    experts = [t.name for t in gguf.GGUFReader(path).tensors if "_exps." in t.name]
    assert experts and sorted(fetched) == sorted(experts)
