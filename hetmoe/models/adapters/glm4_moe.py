"""GLM-4.5/4.6/4.7 (GLM-4-MoE): DeepSeek-V3's router (sigmoid, correction bias, groups, scaling)
and ungated shared experts."""

from __future__ import annotations

import torch
from torch import nn

from .base import MoEAdapter
from .deepseek_v3 import grouped_sigmoid_route


class Glm4MoeAdapter(MoEAdapter):
    model_types = ("glm4_moe",)
    block_classes = ("Glm4MoeMoE",)
    decode_layer = "Glm4MoeDecoderLayer"
    decode_causal_lm = ("Glm4MoeForCausalLM", "CausalLMOutputWithPast")

    @property
    def decode_qk_norm(self) -> str:  # type: ignore[override]
        return "head" if getattr(self.config, "use_qk_norm", False) else "none"

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grouped_sigmoid_route(self, block, x)

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return block.shared_experts(x)
