"""llama.cpp's GGUF tensor names and transformers' for what several architectures share.

Each architecture's adapter file (models/adapters/) holds its own GGUF facts: its llama.cpp
architecture name, the metadata keys it reads and the tensor names only it has, in a
``gguf_config(g, layout)`` that models/gguf_model.py calls; the maps here are the ones they share.
A map takes a tensor's name under ``blk.N.`` to its name under ``model.layers.N.``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# What an adapter's gguf_config returns: the transformers config's fields, and each layer's names.
GGUFConfig = tuple[dict[str, Any], Callable[[int], dict[str, str]]]

NORMS = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
QKV = {f"attn_{x}.{p}": f"self_attn.{x}_proj.{p}" for x in ("q", "k", "v") for p in ("weight", "bias")} | {
    "attn_output.weight": "self_attn.o_proj.weight"
}
QK_NORM = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
ROUTER = {"ffn_gate_inp.weight": "mlp.gate.weight"}
DENSE_MLP = {f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
QWEN2_SHARED = {f"ffn_{p}_shexp.weight": f"mlp.shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")} | {
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight"
}
DEEPSEEK_SHARED = {f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}
# GLM-4-MoE names its post-attention norm for what it is (Qwen3-Next and gpt-oss too).
GLM_NORMS = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
}


def unpermute_rows(heads: int, head_dim: int) -> torch.Tensor:
    """The inverse of convert_hf_to_gguf's ``LlamaModel.permute`` on the rows of q or k: stored row
    ``h * D + 2 i + j`` is transformers' row ``h * D + j * D / 2 + i``; returns, per transformers row,
    the stored row holding it."""
    half = head_dim // 2
    h, i, j = torch.meshgrid(torch.arange(heads), torch.arange(half), torch.arange(2), indexing="ij")
    stored = (h * head_dim + 2 * i + j).flatten()
    original = (h * head_dim + j * half + i).flatten()
    rows = torch.empty(heads * head_dim, dtype=torch.long)
    rows[original] = stored
    return rows
