"""Which path each decoder layer of a loaded model runs, and where it falls back, why.

``load_model`` stores the lines in ``model.hetmoe.layer_paths``; ``model.hetmoe.summary(verbose=True)``
and ``hetmoe generate -v`` print them. Layers that run the same paths are reported once, as a range.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch import nn

from ..runtime.cpu_linear import CPULinear
from ..runtime.fused_linears import FusedLinears, FusedSlice
from ..runtime.hybrid import HybridMoE
from ..runtime.torch_experts import TorchCPUExperts
from .cpu_attention import ATTENTION_NAMES
from .fast_decode import whole_layer_in_one_call
from .ffn_half import mlp_in_one_call


def layer_paths(model: nn.Module) -> list[str]:
    """One line per run of decoder layers with the same paths: ``layers 1-3: attention ...; mlp ...``."""
    inner = getattr(model, "model", None)
    layers = list(getattr(inner, "layers", []) or [])
    lines: list[str] = []
    runs: list[tuple[int, int, str]] = []
    for i, layer in enumerate(layers):
        text = f"attention {_attention(model, layer)}; linears {_linears(layer)}; mlp {_mlp(layer)}"
        if runs and runs[-1][2] == text:
            runs[-1] = (runs[-1][0], i, text)
        else:
            runs.append((i, i, text))
    for first, last, text in runs:
        lines.append(f"layer {first}: {text}" if first == last else f"layers {first}-{last}: {text}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        lines.append(f"lm_head: {_linear(head)}")
    return lines


def _attention(model: nn.Module, layer: nn.Module) -> str:
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        delta = getattr(layer, "linear_attn", None)
        if delta is not None and getattr(delta.__dict__.get("forward"), "hetmoe_delta_rule", False):
            return "delta net: transformers' layer in torch, its one-token rule in the engine (delta_rule.py)"
        return "none (linear attention: transformers' own layer in torch)"
    if getattr(attn.__dict__.get("forward"), "hetmoe_mla", False):
        return "MLA absorbed, latent cache, engine kernels (mla_attention.py)"
    if getattr(layer.__dict__.get("forward"), "hetmoe_fast_decode", False):
        return "one engine call a decode step (fast_decode.py)"
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation in ATTENTION_NAMES:
        modeling = sys.modules.get(type(layer).__module__)
        rope = getattr(getattr(modeling, "apply_rotary_pos_emb", None), "hetmoe_original", None)
        return "transformers' layer, engine attention kernel" + (", engine rotary" if rope else "")
    return f"transformers' {implementation} (not the engine's: the device or attention implementation differs)"


def _linear(mod: nn.Module) -> str:
    if isinstance(mod, CPULinear):
        return f"engine {mod.method}"
    if isinstance(mod, FusedSlice):
        return f"engine {mod._group[0].linear.method}"
    if isinstance(mod, nn.Linear):
        return f"torch {str(mod.weight.dtype).removeprefix('torch.')}"
    return type(mod).__name__


def _linears(layer: nn.Module) -> str:
    """The attention and dense/shared MLP projections (routers excluded) by where they run."""
    kinds: Counter[str] = Counter()
    fused = {id(m.linear) for m in layer.modules() if isinstance(m, FusedLinears)}  # counted as their slices
    routers = {id(c) for m in layer.modules() if isinstance(m, HybridMoE) for c in m.children()}
    for name, mod in layer.named_modules():
        if id(mod) in fused or id(mod) in routers:
            continue
        if name.endswith("kv_b_proj") and getattr(layer.self_attn.__dict__.get("forward"), "hetmoe_mla", False):
            stored = layer.self_attn.__dict__.get("_hetmoe_stored_heads")  # mla_attention.attach_stored_heads
            how = "MLA reads its weight per head"
            if stored:
                how = f"decode per head on the file's {stored.label}, prompts on this weight"
            kinds[f"{_linear(mod)} (kv_b_proj: {how})"] += 1
        elif isinstance(mod, FusedSlice | CPULinear | nn.Linear):
            kinds[_linear(mod)] += 1
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "none"


def _mlp(layer: nn.Module) -> str:
    mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
    if isinstance(mlp, HybridMoE):
        if isinstance(mlp.cpu, TorchCPUExperts):
            return "MoE, routed experts on the torch fallback (the engine lacks this activation)"
        method = getattr(getattr(mlp.cpu, "gate", None), "method", "?")
        if getattr(layer.__dict__.get("forward"), "hetmoe_fast_decode", False) and whole_layer_in_one_call(mlp):
            return f"MoE, routed experts in the engine ({method}), routed and run in the decode step's one call"
        return f"MoE, routed experts in the engine ({method})"
    fast = getattr(layer.__dict__.get("forward"), "hetmoe_fast_decode", False)
    mla_bf16 = layer.__dict__.get("_hetmoe_mla") is None or layer.input_layernorm.weight.dtype == torch.bfloat16
    if fast and mla_bf16 and mlp_in_one_call(mlp):  # (the latent-attention step is bf16 only)
        return "dense, run in the decode step's one call"
    return "dense"
