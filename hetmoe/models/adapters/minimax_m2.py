"""MiniMax-M2: sigmoid scores with an ``e_score_correction_bias`` (a buffer of the block, not of the
router) deciding the choice, renormalised unbiased scores as weights. Checkpoints use Mixtral's
``block_sparse_moe`` names."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..gguf_names import NORMS, QK_NORM, QKV, ROUTER, GGUFConfig
from .base import MoEAdapter
from .routing import BlockRouting, GroupedTopk, grouped_topk, router_logits

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


class MiniMaxM2Adapter(MoEAdapter):
    model_types = ("minimax_m2",)
    block_classes = ("MiniMaxM2SparseMoeBlock",)
    checkpoint_renames = ((".mlp.", ".block_sparse_moe."),)
    decode_layer = "MiniMaxM2DecoderLayer"
    decode_causal_lm = ("MiniMaxM2ForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "projection"
    rms_norms = (("MiniMaxM2RMSNorm", "cast_then_scale", "variance_epsilon"),)

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = block.gate.weight
        logits = router_logits(x.to(weight.dtype), weight)
        return grouped_topk(logits.float(), GroupedTopk(self.top_k(), normalize=True), block.e_score_correction_bias)

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        # `route` rounds x to the router weight's dtype first: logits computed from x in another dtype
        # (an fp32 load of a bf16 router) are not the ones it would take.
        if logits.dtype != block.gate.weight.dtype:
            return None
        routing = self.decode_routing(block)
        return grouped_topk(logits.float(), routing.grouped, routing.bias)

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        # sigmoid scores in fp32, the choice by score + bias, the k weights renormalised
        return BlockRouting(grouped=GroupedTopk(self.top_k(), normalize=True), bias=block.e_score_correction_bias)


# --- its GGUF files: llama.cpp's architecture name, metadata keys and tensor names ---------------

GGUF_ARCHITECTURE = "minimax-m2"

# MiniMax-M2 keeps the selection bias on the MoE block itself
MINIMAX_ROUTER = ROUTER | {"exp_probs_b.bias": "mlp.e_score_correction_bias"}


def gguf_config(g: GGUFModel, layout: MoELayout) -> GGUFConfig:
    fields = g.common(layout)
    g.head_dim_and_rotary(fields)
    g.sigmoid_gating()
    g.no_expert_scale()
    g.all_moe(layout)
    # transformers' MiniMax-M2 sizes its experts with intermediate_size; its router always
    # renormalises the top-k weights (llama.cpp's graph: norm_w = true)
    fields |= {
        "model_type": "minimax_m2",
        "num_local_experts": layout.num_experts,
        "intermediate_size": layout.intermediate_size,
    }
    fields.pop("moe_intermediate_size")

    def names(layer: int) -> dict[str, str]:
        qkv = {k: v for k, v in QKV.items() if not k.endswith(".bias")}
        return NORMS | qkv | QK_NORM | MINIMAX_ROUTER

    return fields, names
