"""gpt-oss: a biased router (top-k of the logits, then softmax over the k), experts with biases and
a clamped SwiGLU, and a block whose forward returns ``(hidden, router_scores)``.

The CPU engine runs this activation as ``"swiglu-oai"`` with the biases; an engine built without
it leaves gpt-oss experts to the torch fallback (``runtime.torch_experts``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .base import Activation, MoEAdapter
from .routing import router_logits, topk_softmax


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation: ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssAdapter(MoEAdapter):
    model_types = ("gpt_oss",)
    block_classes = ("GptOssMLP",)
    router_attr = "router"
    returns_router_scores = True
    decode_layer = "GptOssDecoderLayer"
    decode_causal_lm = ("GptOssForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "none"
    decode_rotary_tables = "half"
    decode_sinks = True

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x, block.router.weight, block.router.bias)
        return topk_softmax(logits, self.top_k())

    @property
    def activation(self) -> Activation:
        alpha, limit = float(self.config.swiglu_alpha), float(self.config.swiglu_limit)
        return lambda gate, up: clamped_swiglu(gate, up, alpha, limit)

    def engine_activation(self) -> dict[str, Any] | None:
        return {
            "activation": "swiglu-oai",
            "alpha": float(self.config.swiglu_alpha),
            "limit": float(self.config.swiglu_limit),
        }
