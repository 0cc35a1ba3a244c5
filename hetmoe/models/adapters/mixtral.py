"""Mixtral: softmax top-k, always renormalised, weights kept in fp32. Hub checkpoints name the
block ``block_sparse_moe`` (transformers 5 calls it ``mlp``)."""

from __future__ import annotations

import torch
from torch import nn

from .base import MoEAdapter
from .routing import router_logits, softmax_topk


class MixtralAdapter(MoEAdapter):
    model_types = ("mixtral",)
    block_classes = ("MixtralSparseMoeBlock",)
    checkpoint_renames = ((".mlp.", ".block_sparse_moe."),)
    decode_layer = "MixtralDecoderLayer"
    decode_causal_lm = ("MixtralForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "none"

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.gate.weight))

    def route_logits(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(logits, self.top_k(), True, None)
