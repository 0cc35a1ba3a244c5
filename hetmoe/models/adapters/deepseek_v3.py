"""DeepSeek-V3/R1/V3.1 and Kimi-K2 (which uses the V3 layout under model_type kimi_k2): sigmoid
scores from an fp32 router, choice by score + e_score_correction_bias among the best n_group
groups, renormalised (norm_topk_prob) and scaled by routed_scaling_factor; ungated shared experts. Latent
attention (MLA) with cos/sin rotary, interleaved pairs where ``rope_interleave`` is set (the
checkpoints' layout), YaRN scaling in the rotary tables and mscale in the attention's ``scaling``.
Its GGUF files are llama.cpp's ``deepseek2``, read by deepseek_v2.py's ``gguf_config``."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .base import MLAAdapter, MoEAdapter
from .routing import BlockRouting, GroupedTopk, grouped_topk, router_logits, v3_grouped


def grouped_sigmoid_routing(adapter: MoEAdapter, block: nn.Module) -> BlockRouting:
    """The DeepSeek-V3 router of ``block.gate`` (its e_score_correction_bias) on fp32 logits, its
    spec from the config (read once: a decode step asks in every layer), and the block's ungated
    shared experts."""
    spec = adapter.__dict__.get("_grouped_spec")
    if spec is None:
        spec = adapter._grouped_spec = _v3_spec(adapter)
    return BlockRouting(
        grouped=spec, bias=block.gate.e_score_correction_bias, fp32=True, shared=block._modules.get("shared_experts")
    )


def _v3_spec(adapter: MoEAdapter) -> GroupedTopk:
    c = adapter.config
    return v3_grouped(
        adapter.top_k(),
        int(c.n_group or 1),
        int(c.topk_group or 1),
        bool(c.norm_topk_prob),
        float(c.routed_scaling_factor),
        getattr(c, "scoring_func", "sigmoid") == "softmax",
    )


def grouped_sigmoid_route(adapter: MoEAdapter, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek-V3 router on ``block.gate`` (weight and e_score_correction_bias)."""
    routing = grouped_sigmoid_routing(adapter, block)
    return grouped_topk(router_logits(x, block.gate.weight, fp32=True), routing.grouped, routing.bias)


class DeepseekV3Adapter(MLAAdapter):
    model_types = ("deepseek_v3", "kimi_k2", "kimi_k25", "deepseek_v32")
    block_classes = ("DeepseekV3MoE",)
    transformers_model_type = "deepseek_v3"
    decode_layer = "DeepseekV3DecoderLayer"
    decode_causal_lm = ("DeepseekV3ForCausalLM", "CausalLMOutputWithPast")
    rms_norms = (("DeepseekV3RMSNorm", "cast_then_scale", "variance_epsilon"),)

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_sigmoid_route(self, block, x)

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return block.shared_experts(x)

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        return grouped_sigmoid_routing(self, block)

    def mla_rotary(
        self, attn: nn.Module, q_rot: torch.Tensor, k_rot: torch.Tensor, position_embeddings: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        modeling = sys.modules[type(attn).__module__]
        cos, sin = position_embeddings
        if attn.config.rope_interleave:
            return modeling.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)
        return modeling.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)

    def mla_rope_mode(self, attn: nn.Module) -> str:
        return "interleaved" if attn.config.rope_interleave else "half"
