"""DeepSeek-V2 (and V2-Lite): softmax scores in fp32 from an fp32 router, greedy or group-limited
top-k, scaled by routed_scaling_factor; ungated shared experts. Latent attention (MLA) whose rotary
part is rotated as complex pairs (modeling_deepseek_v2.apply_rotary_emb, position_embeddings being
the complex ``freqs_cis``). llama.cpp files DeepSeek-V2, V3 and Kimi-K2 alike as ``deepseek2``:
``gguf_config`` below reads such a file into either model type."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...checkpoint import CheckpointError
from ..gguf_names import DEEPSEEK_SHARED, DENSE_MLP, NORMS, ROUTER, GGUFConfig
from .base import MLAAdapter
from .routing import BlockRouting, GroupedTopk, grouped_topk, router_logits, v2_grouped

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


class DeepseekV2Adapter(MLAAdapter):
    model_types = ("deepseek_v2",)
    block_classes = ("DeepseekV2Moe", "DeepseekV2MoE")
    decode_layer = "DeepseekV2DecoderLayer"
    decode_causal_lm = ("DeepseekV2ForCausalLM", "CausalLMOutputWithPast")
    rms_norms = (("DeepseekV2RMSNorm", "cast_then_scale", "variance_epsilon"),)

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_topk(router_logits(x, block.gate.weight, fp32=True), self._spec_once())

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        return BlockRouting(grouped=self._spec_once(), fp32=True, shared=block._modules.get("shared_experts"))

    def _spec_once(self) -> GroupedTopk:
        spec = self.__dict__.get("_grouped_spec")  # read once: a decode step asks in every layer
        if spec is None:
            spec = self._grouped_spec = self._spec()
        return spec

    def _spec(self) -> GroupedTopk:
        c = self.config
        return v2_grouped(
            self.top_k(),
            getattr(c, "topk_method", "greedy") or "greedy",
            c.n_group,
            c.topk_group,
            float(c.routed_scaling_factor),
            # transformers' DeepSeek-V2 ignores the field and no V2 release sets it; a GGUF with softmax
            # gating and expert_weights_norm does (gguf_model.py), and llama.cpp renormalises then
            bool(getattr(c, "norm_topk_prob", False)),
        )

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return block.shared_experts(x)

    def mla_rotary(
        self, attn: nn.Module, q_rot: torch.Tensor, k_rot: torch.Tensor, position_embeddings: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        modeling = sys.modules[type(attn).__module__]
        return modeling.apply_rotary_emb(q_rot, k_rot, position_embeddings.to(q_rot.device))

    def mla_rope_mode(self, attn: nn.Module) -> str:
        return "complex"


# --- its GGUF files: llama.cpp's architecture name, metadata keys and tensor names ---------------

GGUF_ARCHITECTURE = "deepseek2"

# latent attention and the V3 selection bias
MLA = {
    "attn_q.weight": "self_attn.q_proj.weight",  # no q_lora_rank (V2-Lite)
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # older files; newer split it into k_b / v_b
    "attn_output.weight": "self_attn.o_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}


def gguf_config(g: GGUFModel, layout: MoELayout) -> GGUFConfig:
    m = g.meta
    fields = g.common(layout)
    heads = fields["num_attention_heads"]
    rope_dim = m.count("rope.dimension_count", "qk_rope_head_dim")
    # Since llama.cpp split kv_b_proj (MLA absorption), key/value_length describe the compressed
    # MQA view and the *_mla keys the per-head sizes; older files only have the per-head ones.
    if m.get("attention.key_length_mla") is not None:
        key_dim = m.count("attention.key_length_mla", "qk_nope_head_dim + qk_rope_head_dim")
        value_dim = m.count("attention.value_length_mla", "v_head_dim")
    else:
        key_dim = m.count("attention.key_length", "qk_nope_head_dim + qk_rope_head_dim")
        value_dim = m.count("attention.value_length", "v_head_dim")
    if key_dim <= rope_dim:
        raise CheckpointError(
            m.path, f"deepseek2: key length {key_dim} must exceed rope.dimension_count {rope_dim} (qk_nope > 0)"
        )
    q_lora = m.get("attention.q_lora_rank")
    gating = m.get("expert_gating_func")
    sigmoid = gating == 2  # llama.cpp: 1 softmax (the default of V2 files), 2 sigmoid
    sample = layout.moe_layers[0]
    # DeepSeek-V3's layout: a selection bias (e_score_correction_bias), which llama.cpp adds to the
    # selection scores whatever the gating function
    biased = f"blk.{sample}.exp_probs_b.bias" in g.tensors
    if gating is None:
        g.notes.append(
            "deepseek2: no expert_gating_func in the metadata: softmax gating, as llama.cpp assumes"
            + (" (with the file's selection bias, as llama.cpp adds it)" if biased else "")
        )
    scale = m.number("expert_weights_scale", "routed_scaling_factor", 1.0) or 1.0  # 0: llama.cpp's "unset"
    norm = bool(m.get("expert_weights_norm", False))
    groups = m.count("expert_group_count", "n_group", 1)
    groups_used = m.count("expert_group_used_count", "topk_group", 1)
    shared_rows = g.shape(f"blk.{sample}.ffn_up_shexp.weight", "the shared experts")[0]
    fields |= {
        "model_type": "deepseek_v3" if sigmoid or biased else "deepseek_v2",
        "num_key_value_heads": heads,  # the file says 1: llama.cpp's MQA view of MLA
        "head_dim": rope_dim,
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": m.count("attention.kv_lora_rank", "kv_lora_rank"),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_dim - rope_dim,
        "v_head_dim": value_dim,
        "n_routed_experts": layout.num_experts,
        "n_shared_experts": m.count(
            "expert_shared_count", "n_shared_experts", max(1, shared_rows // layout.intermediate_size)
        ),
        "first_k_dense_replace": int(m.get("leading_dense_block_count", 0)),
        "routed_scaling_factor": scale,
        "n_group": groups,
        "topk_group": groups_used,
        "norm_topk_prob": norm,
        "rope_parameters": g.rope(),
    }
    mscale = m.get("rope.scaling.yarn_log_multiplier")
    if fields["rope_parameters"]["rope_type"] == "yarn" and mscale:
        # convert_hf_to_gguf writes 0.1 * mscale_all_dim here (its TAG_DEEPSEEK2_YARN_LOG_MUL_FIX);
        # every DeepSeek/Kimi release has mscale == mscale_all_dim.
        fields["rope_parameters"] |= {"mscale_all_dim": float(mscale) / 0.1, "mscale": float(mscale) / 0.1}
    dense = [layer for layer in range(layout.num_layers) if layer not in layout.moe_layers]
    width = m.get("feed_forward_length")
    if dense:
        width = g.shape(f"blk.{dense[0]}.ffn_up.weight", "a dense layer's MLP")[0]
    if width:
        fields["intermediate_size"] = int(width)
    if sigmoid or biased:
        fields["rope_interleave"] = True  # llama.cpp's deepseek2 rope is the interleaved (GPT-J) one
        if not sigmoid:
            fields["scoring_func"] = "softmax"  # DeepSeek's own config field (deepseek_v3 adapter)
    else:
        # softmax with expert_weights_norm: llama.cpp renormalises the top-k weights before the
        # scale; the DeepSeek-V2 adapter does too where norm_topk_prob is set (no V2 release sets it)
        fields["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    if dense and dense != list(range(fields["first_k_dense_replace"])):
        raise CheckpointError(
            m.path,
            f"deepseek2: layers {dense[:8]} have no experts but leading_dense_block_count="
            f"{fields['first_k_dense_replace']}",
        )

    def names(layer: int) -> dict[str, str]:
        attention = {k: v for k, v in MLA.items() if not k.startswith(("attn_q", "exp_probs_b"))}
        if fields["q_lora_rank"]:
            attention |= {k: v for k, v in MLA.items() if k.startswith("attn_q_")}
        else:
            attention["attn_q.weight"] = MLA["attn_q.weight"]
        if layer not in layout.moe_layers:
            return NORMS | attention | DENSE_MLP
        mlp = ROUTER | DEEPSEEK_SHARED
        if sigmoid or biased:
            mlp = mlp | {"exp_probs_b.bias": MLA["exp_probs_b.bias"]}
        return NORMS | attention | mlp

    g.kv_b_split = {
        "heads": heads,
        "nope": key_dim - rope_dim,
        "value": value_dim,
        "rank": fields["kv_lora_rank"],
    }
    return fields, names
