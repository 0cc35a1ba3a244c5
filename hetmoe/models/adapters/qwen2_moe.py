"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): softmax top-k plus one shared expert whose output is
scaled by a sigmoid gate."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ...runtime.engine_activations import engine_sigmoid
from ..gguf_names import DENSE_MLP, NORMS, QKV, QWEN2_SHARED, ROUTER, GGUFConfig
from .base import MoEAdapter
from .routing import BlockRouting, router_logits, softmax_topk

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


def gated_shared_expert(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(shared_expert_gate(x)) * shared_expert(x)``, the Qwen2-MoE / Qwen3-Next form. The
    gate's logit as routing.py's router_logits computes a router's (in the engine on the CPU), its
    sigmoid the engine's there (runtime/engine_activations.py): what the one-call decode layer
    computes (csrc/decode_step.h: DecodeMoEHalf::shared_gate)."""
    gate = block.shared_expert_gate
    return engine_sigmoid(router_logits(x, gate.weight, gate.bias)) * block.shared_expert(x)


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

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        return BlockRouting(
            softmax=(self.top_k(), bool(self.config.norm_topk_prob), True),
            shared=block.shared_expert,
            shared_gate=block.shared_expert_gate,
        )


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
