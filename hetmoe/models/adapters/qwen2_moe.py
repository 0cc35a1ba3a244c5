"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): softmax top-k plus one shared expert whose output is
scaled by a sigmoid gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import MoEAdapter
from .routing import router_logits, softmax_topk


def gated_shared_expert(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(shared_expert_gate(x)) * shared_expert(x)``, the Qwen2-MoE / Qwen3-Next form."""
    return F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


class Qwen2MoeAdapter(MoEAdapter):
    model_types = ("qwen2_moe",)
    block_classes = ("Qwen2MoeSparseMoeBlock",)
    decode_layer = "Qwen2MoeDecoderLayer"
    decode_causal_lm = ("Qwen2MoeForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "none"

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.gate.weight))

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, self.top_k(), bool(self.config.norm_topk_prob), logits.dtype)

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return gated_shared_expert(block, x)
