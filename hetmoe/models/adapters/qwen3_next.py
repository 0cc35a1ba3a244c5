"""Qwen3-Next: Qwen2-MoE's routing (softmax top-k, norm_topk_prob) and sigmoid-gated shared expert,
behind hybrid layers: three of four mix tokens with a gated delta net (their one-token rule in the
engine, models/delta_rule.py, inside transformers' layer code), the fourth with full attention whose
query carries a gate (output times sigmoid(gate)); a full-attention layer's decode step is one engine
call (models/fast_decode.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...checkpoint import CheckpointError
from ...checkpoint.config import qwen3next_layer_types
from ..gguf_names import DENSE_MLP, GLM_NORMS, QK_NORM, QKV, QWEN2_SHARED, ROUTER, GGUFConfig
from .base import MoEAdapter
from .qwen2_moe import gated_shared_expert
from .routing import BlockRouting, router_logits, softmax_topk

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


class Qwen3NextAdapter(MoEAdapter):
    model_types = ("qwen3_next",)
    block_classes = ("Qwen3NextSparseMoeBlock",)
    rms_norms = (("Qwen3NextRMSNorm", "offset_scale", "eps"),)
    # the full-attention layers' one-token step; the delta-net layers (no self_attn) keep their forward
    decode_layer = "Qwen3NextDecoderLayer"
    decode_qk_norm = "head"
    decode_gated_query = True

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.gate.weight))

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, self.top_k(), bool(self.config.norm_topk_prob), logits.dtype)

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return gated_shared_expert(block, x)

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        return BlockRouting(
            softmax=(self.top_k(), bool(self.config.norm_topk_prob), True),
            shared=block.shared_expert,
            shared_gate=block.shared_expert_gate,
        )


# --- its GGUF files: llama.cpp's architecture name, metadata keys and tensor names ---------------

GGUF_ARCHITECTURE = "qwen3next"

# the delta-net layers' names; in_proj_qkvz has no tensor of its own (``ssm_in``: joined from
# attn_qkv and attn_gate by models/gguf_model.py); the full-attention layers' are Qwen3-MoE's
NEXT_LINEAR = {
    "ssm_in.weight": "linear_attn.in_proj_qkvz.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# its norms whose weight is zero-centred (transformers computes (1 + w) * x), stored as 1 + w
NEXT_OFFSET_NORMS = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight")


def recurrent_layers(g: GGUFModel, layers: int) -> list[str]:
    """The layer kinds (checkpoint/config.py: qwen3next_layer_types), or an error naming the keys."""
    flags, interval = g.meta.get("attention.recurrent_layers"), g.meta.get("full_attention_interval", 4)
    types = qwen3next_layer_types(flags, interval, layers)
    if types is None:
        raise CheckpointError(
            g.meta.path,
            f"qwen3next.attention.recurrent_layers: expected {layers} flags, found {flags!r} "
            f"(or without it, full_attention_interval a positive count, found {interval!r})",
        )
    return types


def gguf_config(g: GGUFModel, layout: MoELayout) -> GGUFConfig:
    m = g.meta
    fields = g.common(layout)
    head_dim = m.count("attention.key_length", "head_dim")
    value_dim = m.count("attention.value_length", "the value head size", head_dim)
    if value_dim != head_dim:
        raise CheckpointError(
            m.path, f"qwen3next: key_length={head_dim}, value_length={value_dim}: transformers needs them equal"
        )
    rotary = m.count("rope.dimension_count", "the rotary dimensions", head_dim)
    value_heads = m.count("ssm.time_step_rank", "linear_num_value_heads")
    inner = m.count("ssm.inner_size", "the delta-net's value width")
    if inner % value_heads:
        raise CheckpointError(
            m.path, f"qwen3next.ssm.inner_size={inner} is not a multiple of ssm.time_step_rank={value_heads}"
        )
    g.no_expert_scale()
    sample = layout.moe_layers[0]
    fields |= {
        "model_type": "qwen3_next",
        "num_key_value_heads": m.count("attention.head_count_kv", "num_key_value_heads"),
        "head_dim": head_dim,
        "rope_parameters": g.rope() | {"partial_rotary_factor": rotary / head_dim},
        "num_experts": layout.num_experts,
        "norm_topk_prob": True,  # llama.cpp's qwen3next graph: norm_w = true
        "shared_expert_intermediate_size": g.shape(f"blk.{sample}.ffn_up_shexp.weight", "the shared expert")[0],
        "layer_types": recurrent_layers(g, layout.num_layers),
        "linear_conv_kernel_dim": m.count("ssm.conv_kernel", "linear_conv_kernel_dim"),
        "linear_key_head_dim": m.count("ssm.state_size", "linear_key_head_dim"),
        "linear_num_key_heads": m.count("ssm.group_count", "linear_num_key_heads"),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "attention_bias": False,
    }
    g.qwen_layers(fields, layout)
    attention = {k: v for k, v in QKV.items() if not k.endswith(".bias")} | QK_NORM
    types = fields["layer_types"]

    def names(layer: int) -> dict[str, str]:
        mixer = NEXT_LINEAR if types[layer] == "linear_attention" else attention
        mlp = ROUTER | QWEN2_SHARED if layer in layout.moe_layers else DENSE_MLP
        return GLM_NORMS | mixer | mlp

    return fields, names
