"""OLMoE: softmax top-k like Qwen3-MoE (renormalised only when norm_topk_prob), no shared experts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..gguf_names import NORMS, QK_NORM, QKV, ROUTER, GGUFConfig
from .base import MoEAdapter
from .routing import BlockRouting, router_logits

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


class OlmoeAdapter(MoEAdapter):
    model_types = ("olmoe",)
    block_classes = ("OlmoeSparseMoeBlock",)
    decode_layer = "OlmoeDecoderLayer"
    decode_causal_lm = ("OlmoeForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "projection"
    standard_rotary = True
    rms_norms = (("OlmoeRMSNorm", "cast_then_scale", "variance_epsilon"),)

    def decodes_in_one_call(self) -> bool:
        # clip_qkv clamps q, k and v after the norms, a step the one-token path does not take
        return getattr(self.config, "clip_qkv", None) is None

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.gate.weight))

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        return BlockRouting(softmax=(self.top_k(), bool(self.config.norm_topk_prob), True))


# --- its GGUF files: llama.cpp's architecture name, metadata keys and tensor names ---------------

GGUF_ARCHITECTURE = "olmoe"


def gguf_config(g: GGUFModel, layout: MoELayout) -> GGUFConfig:
    fields = g.gqa_fields(layout)
    g.all_moe(layout)
    g.no_expert_scale()
    fields |= {
        "model_type": "olmoe",
        "num_experts": layout.num_experts,
        "intermediate_size": layout.intermediate_size,  # OLMoE's config names the experts' width so
        "norm_topk_prob": False,
        "attention_bias": False,
        "clip_qkv": None,
    }
    attention = {k: v for k, v in QKV.items() if not k.endswith(".bias")} | QK_NORM

    def names(layer: int) -> dict[str, str]:
        return NORMS | attention | ROUTER

    return fields, names
