"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): softmax top-k plus one shared expert whose output is
scaled by a sigmoid gate."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ..gguf_names import DENSE_MLP, NORMS, QKV, QWEN2_SHARED, ROUTER, GGUFConfig
from .base import MoEAdapter
from .routing import router_logits, softmax_topk

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


def gated_shared_expert(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(shared_expert_gate(x)) * shared_expert(x)``, the Qwen2-MoE / Qwen3-Next form."""
    return F.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


class Qwen2MoeAdapter(MoEAdapter):
    model_types = ("qwen2_moe",)
    block_classes = ("Qwen2MoeSparseMoeBlock",)
    decode_layer = "Qwen2MoeDecoderLayer"
    decode_causal_lm = ("Qwen2MoeForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "none"
    standard_rotary = True
    rms_norms = (("Qwen2MoeRMSNorm", "cast_then_scale", "variance_epsilon"),)

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.gate.weight))

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, self.top_k(), bool(self.config.norm_topk_prob), logits.dtype)

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        return gated_shared_expert(block, x)


# --- its GGUF files: llama.cpp's architecture name, metadata keys and tensor names ---------------

GGUF_ARCHITECTURE = "qwen2moe"


def gguf_config(g: GGUFModel, layout: MoELayout) -> GGUFConfig:
    fields = g.qwen_fields(layout, "qwen2_moe", norm_topk_prob=False)
    fields["qkv_bias"] = "blk.0.attn_q.bias" in g.tensors
    fields["use_sliding_window"] = False
    g.qwen_layers(fields, layout)
    g.no_expert_scale()
    # llama.cpp takes this from expert_shared_feed_forward_length (else the dense width) and checks
    # it against the tensors; the tensor is the one truth here.
    shared = f"blk.{layout.moe_layers[0]}.ffn_up_shexp.weight"
    fields["shared_expert_intermediate_size"] = g.shape(shared, "the shared expert")[0]

    def names(layer: int) -> dict[str, str]:
        qkv = {k: v for k, v in QKV.items() if fields["qkv_bias"] or not k.endswith(".bias")}
        mlp = ROUTER | QWEN2_SHARED if layer in layout.moe_layers else DENSE_MLP
        return NORMS | qkv | mlp

    return fields, names
