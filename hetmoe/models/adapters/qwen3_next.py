"""Qwen3-Next: Qwen2-MoE's routing (softmax top-k, norm_topk_prob) and sigmoid-gated shared expert,
behind hybrid linear/full attention layers that hetmoe leaves to transformers."""

from __future__ import annotations

import torch
from torch import nn

from .base import MoEAdapter
from .qwen2_moe import gated_shared_expert
from .routing import router_logits, softmax_topk


class Qwen3NextAdapter(MoEAdapter):
    model_types = ("qwen3_next",)
    block_classes = ("Qwen3NextSparseMoeBlock",)

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x, block.gate.weight)
        return softmax_topk(logits, self.top_k(), bool(self.config.norm_topk_prob), logits.dtype)

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return gated_shared_expert(block, x)
