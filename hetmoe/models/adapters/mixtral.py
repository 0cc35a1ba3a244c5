"""Mixtral: softmax top-k, always renormalised, weights kept in fp32. Hub checkpoints name the
block ``block_sparse_moe`` (transformers 5 calls it ``mlp``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..gguf_names import NORMS, QKV, ROUTER, GGUFConfig, unpermute_rows
from .base import MoEAdapter
from .routing import BlockRouting, router_logits

if TYPE_CHECKING:
    from ...checkpoint.layout import MoELayout
    from ..gguf_model import GGUFModel


class MixtralAdapter(MoEAdapter):
    model_types = ("mixtral",)
    block_classes = ("MixtralSparseMoeBlock",)
    checkpoint_renames = ((".mlp.", ".block_sparse_moe."),)
    decode_layer = "MixtralDecoderLayer"
    decode_causal_lm = ("MixtralForCausalLM", "MoeCausalLMOutputWithPast")
    decode_qk_norm = "none"
    standard_rotary = True
    rms_norms = (("MixtralRMSNorm", "cast_then_scale", "variance_epsilon"),)

    def route(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_logits(block, router_logits(x, block.gate.weight))

    def decode_routing(self, block: nn.Module) -> BlockRouting:
        return BlockRouting(softmax=(self.top_k(), True, False))


# --- its GGUF files: llama.cpp's architecture name, metadata keys and tensor names ---------------

GGUF_ARCHITECTURE = "llama"


def gguf_config(g: GGUFModel, layout: MoELayout) -> GGUFConfig:
    """Mixtral, which llama.cpp files as llama with experts: softmax top-k renormalised (its graph's
    norm_w), every layer MoE, q and k rows permuted by the converter for ggml's interleaved rope
    (``LlamaModel.permute``), put back in transformers' order by models/gguf_model.py's ``_entries``."""
    fields = g.gqa_fields(layout)
    g.no_expert_scale()
    g.all_moe(layout)
    fields |= {"model_type": "mixtral", "num_local_experts": layout.num_experts}
    fields["intermediate_size"] = fields.pop("moe_intermediate_size")
    g.permuted_rows = {
        "attn_q.weight": unpermute_rows(fields["num_attention_heads"], fields["head_dim"]),
        "attn_k.weight": unpermute_rows(fields["num_key_value_heads"], fields["head_dim"]),
    }

    def names(layer: int) -> dict[str, str]:
        qkv = {k: v for k, v in QKV.items() if not k.endswith(".bias")}
        return NORMS | qkv | ROUTER

    return fields, names
