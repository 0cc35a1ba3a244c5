"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): softmax top-k, renormalised when norm_topk_prob."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..gguf_names import DENSE_MLP, NORMS, QK_NORM, QKV, ROUTER, GGUFConfig
from .base import MoEAdapter
from .routing import BlockRouting, router_logits

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


class Qwen3MoeAdapter(MoEAdapter):
    model_types = ("qwen3_moe",)
    block_classes = ("Qwen3MoeSparseMoeBlock",)
    decode_layer = "Qwen3MoeDecoderLayer"
    decode_causal_lm = ("Qwen3MoeForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "head"
    standard_rotary = True
    rms_norms = (("Qwen3MoeRMSNorm", "cast_then_scale", "variance_epsilon"),)

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.gate.weight))

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        return BlockRouting(softmax=(self.top_k(), bool(self.config.norm_topk_prob), True))


# --- its GGUF files: llama.cpp's architecture name, metadata keys and tensor names ---------------

GGUF_ARCHITECTURE = "qwen3moe"


def gguf_config(g: GGUFModel, layout: MoELayout) -> GGUFConfig:
    fields = g.qwen_fields(layout, "qwen3_moe", norm_topk_prob=True)
    fields["attention_bias"] = "blk.0.attn_q.bias" in g.tensors
    g.qwen_layers(fields, layout)
    g.no_expert_scale()

    def names(layer: int) -> dict[str, str]:
        bias = fields["attention_bias"]
        qkv = {k: v for k, v in QKV.items() if bias or not k.endswith(".bias")}
        mlp = ROUTER if layer in layout.moe_layers else DENSE_MLP
        return NORMS | qkv | QK_NORM | mlp

    return fields, names
