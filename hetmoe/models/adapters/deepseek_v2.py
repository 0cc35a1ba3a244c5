"""DeepSeek-V2 (and V2-Lite): softmax scores in fp32 from an fp32 router, greedy or group-limited
top-k, scaled by routed_scaling_factor; ungated shared experts. Latent attention (MLA) whose rotary
part is rotated as complex pairs (modeling_deepseek_v2.apply_rotary_emb, position_embeddings being
the complex ``freqs_cis``)."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from .base import MLAAdapter
from .routing import router_logits, softmax_group_limited_topk


class DeepseekV2Adapter(MLAAdapter):
    model_types = ("deepseek_v2",)
    block_classes = ("DeepseekV2Moe", "DeepseekV2MoE")
    decode_layer = "DeepseekV2DecoderLayer"
    decode_causal_lm = ("DeepseekV2ForCausalLM", "CausalLMOutputWithPast")

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = router_logits(x, block.gate.weight, fp32=True)
        method = getattr(c, "topk_method", "greedy") or "greedy"
        return softmax_group_limited_topk(
            logits,
            self.top_k(),
            method,
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
