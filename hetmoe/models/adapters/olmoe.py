"""OLMoE: softmax top-k like Qwen3-MoE (renormalised only when norm_topk_prob), no shared experts."""

from __future__ import annotations

import torch
from torch import nn

from .base import MoEAdapter
from .routing import router_logits, softmax_topk


class OlmoeAdapter(MoEAdapter):
    model_types = ("olmoe",)
    block_classes = ("OlmoeSparseMoeBlock",)
    decode_layer = "OlmoeDecoderLayer"
    decode_causal_lm = ("OlmoeForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "projection"

    def decodes_in_one_call(self) -> bool:
        # clip_qkv clamps q, k and v after the norms, a step the one-token path does not take
        return getattr(self.config, "clip_qkv", None) is None

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.gate.weight))

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, self.top_k(), bool(self.config.norm_topk_prob), logits.dtype)
