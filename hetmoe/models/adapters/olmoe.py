"""OLMoE: softmax top-k like Qwen3-MoE (renormalised only when norm_topk_prob), no shared experts."""

from __future__ import annotations

import torch
from torch import nn

from .base import MoEAdapter
from .routing import router_logits, softmax_topk


class OlmoeAdapter(MoEAdapter):
    model_types = ("olmoe",)
    block_classes = ("OlmoeSparseMoeBlock",)

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x, block.gate.weight)
        return softmax_topk(logits, self.top_k(), bool(self.config.norm_topk_prob), logits.dtype)
