"""MiniMax-M2: sigmoid scores with an ``e_score_correction_bias`` (a buffer of the block, not of the
router) deciding the choice, renormalised unbiased scores as weights. Checkpoints use Mixtral's
``block_sparse_moe`` names."""

from __future__ import annotations

import torch
from torch import nn

from .base import MoEAdapter
from .routing import router_logits, sigmoid_biased_topk


class MiniMaxM2Adapter(MoEAdapter):
    model_types = ("minimax_m2",)
    block_classes = ("MiniMaxM2SparseMoeBlock",)
    checkpoint_renames = ((".mlp.", ".block_sparse_moe."),)
    decode_layer = "MiniMaxM2DecoderLayer"
    decode_causal_lm = ("MiniMaxM2ForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "projection"

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight = block.gate.weight
        logits = router_logits(x.to(weight.dtype), weight)
        return sigmoid_biased_topk(logits, block.e_score_correction_bias, self.top_k())

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        # `route` rounds x to the router weight's dtype first: logits computed from x in another dtype
        # (an fp32 load of a bf16 router) are not the ones it would take.
        if logits.dtype != block.gate.weight.dtype:
            return None
        return sigmoid_biased_topk(logits, block.e_score_correction_bias, self.top_k())
