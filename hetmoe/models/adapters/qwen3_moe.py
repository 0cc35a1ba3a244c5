"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax top-k, renormalised when norm_topk_prob."""

from __future__ import annotations

import torch
from torch import nn

from .base import MoEAdapter
from .routing import router_logits, softmax_topk


class Qwen3MoeAdapter(MoEAdapter):
    model_types = ("qwen3_moe",)
    block_classes = ("Qwen3MoeSparseMoeBlock",)
    decode_layer = "Qwen3MoeDecoderLayer"
    decode_causal_lm = ("Qwen3MoeForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "head"

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.gate.weight))

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, self.top_k(), bool(self.config.norm_topk_prob), logits.dtype)
