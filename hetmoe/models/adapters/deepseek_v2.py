"""DeepSeek-V2 (and V2-Lite): softmax scores in fp32 from an fp32 router, greedy or group-limited
top-k, scaled by routed_scaling_factor; ungated shared experts."""

from __future__ import annotations

import torch
from torch import nn

from .base import MoEAdapter
from .routing import router_logits, softmax_group_limited_topk


class DeepseekV2Adapter(MoEAdapter):
    model_types = ("deepseek_v2",)
    block_classes = ("DeepseekV2Moe", "DeepseekV2MoE")

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = router_logits(x, block.gate.weight, fp32=True)
        method = getattr(c, "topk_method", "greedy") or "greedy"
        return softmax_group_limited_topk(
            logits, self.top_k(), method, c.n_group, c.topk_group, float(c.routed_scaling_factor)
        )

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return block.shared_experts(x)
