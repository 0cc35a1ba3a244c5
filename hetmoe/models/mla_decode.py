"""The one-call decode step for latent-attention layers (DeepSeek-V2/V3/R1, Kimi-K2).

For one token of one sequence, a DeepSeek decoder layer's attention half is ~25 Python-level calls
in the absorbed forward (models/mla_attention.py): the input norm, the fused q_a/kv_a linear, q_a's
norm, q_b, the latent's norm, the rotary embedding in torch ops, the cache append, the per-head W_UK
product, the attention kernel, the per-head W_UV product, o_proj, the residual add and the
post-attention norm. ``DecodeMLABlock`` (csrc/mla_step.h) does them in one engine call, with the same
kernels in the same order and the same roundings, so the same values (tests/test_mla_decode.py holds
the two bit-identical over many steps). The rotation is the adapter's (``MLAAdapter.mla_rope_mode``).

From a GGUF file whose kv_b_proj is split into attn_k_b and attn_v_b (llama.cpp's converter since
2025), the per-head W_UK^T and W_UV products read those tensors' own blocks
(``mla_attention.attach_stored_heads``): on a DeepSeek-V2-Lite-shaped Q4_0 file kv_b_proj is ~5% of
a decode step's bytes in bf16 and a quarter of that as stored, and the products then use the file's
values, not their bf16 roundings.

models/fast_decode.py calls ``one_token_mla`` for the layers ``mla_layer_eligible`` accepts; it
returns None (transformers' forward then runs) where the step does not apply: another dtype than
bf16, a cache that does not append in place, widths the kernels do not take.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn

from ..kernels.dispatch import engine_module
from ..runtime.cpu_linear import CPULinear
from ..runtime.fused_linears import FusedLinears, FusedSlice
from ..runtime.hybrid import HybridMoE
from .adapters.base import MLAAdapter
from .ffn_half import set_ffn_half
from .fused_norms import norm_spec
from .mla_attention import _absorbed_weights, stored_heads, weight_state

ROPE_MODES = {"interleaved": 0, "half": 1, "complex": 2}  # csrc/mla_step.h: MLARope


def mla_layer_eligible(layer: nn.Module) -> bool:
    """The layer has what the step reads: engine linears for q and kv_a (fused or not) and o_proj, fused
    norms, kv_b_proj a plain Linear (its weight is read in place), and the absorbed forward installed."""
    attn = getattr(layer, "self_attn", None)
    if attn is None or not getattr(attn.__dict__.get("forward"), "hetmoe_mla", False):
        return False
    if type(getattr(attn, "kv_b_proj", None)) is not nn.Linear or attn.kv_b_proj.bias is not None:
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.kv_a_layernorm]
    if attn.q_lora_rank is not None:
        norms.append(attn.q_a_layernorm)
    return (
        _linears(attn) is not None
        and isinstance(attn.o_proj, CPULinear)
        and all(hasattr(n, "_hetmoe_mode") for n in norms)  # fused_norms.py
    )


def mla_parts(layer: nn.Module) -> list[nn.Module]:
    """The modules the step stands in for, whose hooks it would skip (KeyError where one was removed)."""
    attn = layer._modules["self_attn"]
    mods = attn._modules
    names = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    names += ["q_a_proj", "q_a_layernorm", "q_b_proj"] if attn.q_lora_rank is not None else ["q_proj"]
    parts = [layer, attn, layer._modules["input_layernorm"], layer._modules["post_attention_layernorm"]]
    parts += [mods[n] for n in names] + [layer._modules["mlp"]]
    if "fused_q_kv_a_proj" in mods:
        parts.append(mods["fused_q_kv_a_proj"])
    return parts


def _linears(attn: nn.Module) -> tuple[CPULinear, CPULinear | None] | None:
    """(q_in, kv_a): one engine linear over q's input rows then kv_a's where the two were fused
    (runtime/fused_linears.py: q_a_proj with kv_a_proj_with_mqa), else the two; None where either is
    not an engine linear."""
    mods = attn._modules
    q = mods.get("q_a_proj" if attn.q_lora_rank is not None else "q_proj")
    kv = mods.get("kv_a_proj_with_mqa")
    group = mods.get("fused_q_kv_a_proj")
    if isinstance(q, FusedSlice) and isinstance(kv, FusedSlice) and isinstance(group, FusedLinears):
        if q._group[0] is group and kv._group[0] is group and (q.member, kv.member) == (0, 1):
            return group.linear, None
        return None
    if isinstance(q, CPULinear) and isinstance(kv, CPULinear):
        return q, kv
    return None


def _block(layer: nn.Module, adapter: MLAAdapter) -> Any:
    """The layer's engine block, made once and again whenever a module or weight it reads is replaced
    (or a weight's storage is: the data pointers are compared too); None where the shapes do not fit."""
    attn = layer._modules["self_attn"]
    mods = attn._modules
    linears = _linears(attn)
    if linears is None:
        return None
    norms = [layer._modules["input_layernorm"], mods.get("q_a_layernorm"), mods["kv_a_layernorm"]]
    norms.append(layer._modules["post_attention_layernorm"])
    weights = [None if n is None else n._parameters["weight"] for n in norms]
    weights.append(mods["kv_b_proj"]._parameters["weight"])
    parts = (*weights, *linears, mods.get("q_b_proj"), mods["o_proj"])
    # kv_b's version too: the block reads a W_UK^T copy of it (mla_attention._absorbed_weights)
    pointers = (*(None if w is None else w.data_ptr() for w in weights), weight_state(weights[-1]))
    cached = layer.__dict__.get("_hetmoe_mla_block")
    if cached is not None and cached[1] == pointers and all(map(operator.is_, cached[0], parts)):
        return cached[2]
    made = _make_block(layer, adapter, linears)
    layer._hetmoe_mla_block = (parts, pointers, made)
    return made


def _make_block(layer: nn.Module, adapter: MLAAdapter, linears: tuple[CPULinear, CPULinear | None]) -> Any:
    attn = layer.self_attn
    dtype = torch.bfloat16
    heads, nope, rope = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    rank, v_dim, q_rank = attn.kv_lora_rank, attn.v_head_dim, attn.q_lora_rank or 0
    hidden = attn.o_proj.out_features
    if nope % 16 or rank % 16 or rope % 16:
        return None
    norms = [layer.input_layernorm, attn.q_a_layernorm if q_rank else None, attn.kv_a_layernorm]
    norms.append(layer.post_attention_layernorm)
    widths = [hidden, q_rank, rank, hidden]
    for n, w in zip(norms, widths, strict=True):
        if n is not None and (n.weight.dtype != dtype or n.weight.shape != (w,) or not n.weight.is_contiguous()):
            return None
    if attn.kv_b_proj.weight.dtype != dtype:
        return None
    stored = stored_heads(attn)
    if stored is not None:
        uk, uv = stored.uk, stored.uv
        keep = None
    else:
        w_uk_t, w_uv = _absorbed_weights(attn)
        uk = (w_uk_t.data_ptr(), w_uk_t.stride(0) * 2, w_uk_t.stride(1) * 2)
        uv = (w_uv.data_ptr(), w_uv.stride(0) * 2, w_uv.stride(1) * 2)
        keep = w_uk_t  # the W_UK^T copy the block reads stays alive with it
    q_in, kv_a = linears
    q_b = attn.q_b_proj if q_rank else None
    if q_rank and not isinstance(q_b, CPULinear):
        return None
    try:
        block = engine_module().DecodeMLABlock(
            hidden,
            heads,
            nope,
            rope,
            rank,
            v_dim,
            q_rank,
            tuple((0, 0.0, 0) if n is None else norm_spec(n) for n in norms),
            ROPE_MODES[adapter.mla_rope_mode(attn)],
            float(attn.scaling),
            q_in._engine,
            None if kv_a is None else kv_a._engine,
            None if q_b is None else q_b._engine,
            uk,
            uv,
            attn.o_proj._engine,
        )
    except ValueError:  # sizes the block refuses (a linear of another shape): transformers' forward
        return None
    return block, keep


def _tables(adapter: MLAAdapter, attn: nn.Module, position_embeddings: Any) -> tuple[torch.Tensor, Any] | None:
    """(cos, sin) as the block reads them for this token: bf16 ``[1, 1, rope]`` tables, or for the
    complex rotation the fp32 (re, im) pairs of ``freqs_cis`` (sin unused); None where they are not."""
    rope = attn.qk_rope_head_dim
    if adapter.mla_rope_mode(attn) == "complex":
        freqs = position_embeddings
        if not isinstance(freqs, torch.Tensor) or freqs.dtype != torch.complex64 or freqs.numel() != rope // 2:
            return None
        pairs = torch.view_as_real(freqs).contiguous()
        return pairs, pairs
    cos, sin = position_embeddings
    for t in (cos, sin):
        if t.dtype != torch.bfloat16 or t.numel() != rope or not t.is_contiguous():
            return None
    return cos, sin


def one_token_mla(
    layer: nn.Module, adapter: MLAAdapter, x: torch.Tensor, cache: Any, position_embeddings: Any
) -> torch.Tensor | None:
    """transformers' decoder layer for one token with the absorbed attention half as one engine call;
    None where it does not apply."""
    attn = layer._modules["self_attn"]
    if x.dtype != torch.bfloat16 or not x.is_contiguous() or x.numel() != attn._modules["o_proj"].out_features:
        return None
    made = _block(layer, adapter)
    tables = _tables(adapter, attn, position_embeddings)
    if made is None or tables is None:
        return None
    block, _ = made
    rank, rope = attn.kv_lora_rank, attn.qk_rope_head_dim
    layer_cache = cache.layers[attn.layer_idx]
    free_row = getattr(layer_cache, "free_row", None)
    free = free_row(1, rank + rope, torch.bfloat16, value_dim=0) if free_row is not None else None
    if free is None:
        return None
    row, kbuf, _, _ = free
    hidden = x.shape[-1]
    x_out = torch.empty(1, 1, hidden, dtype=x.dtype)
    h_out = torch.empty(1, 1, hidden, dtype=x.dtype)
    cos, sin = tables
    mlp = layer._modules["mlp"]
    set_ffn_half(layer, mlp, block)
    ffn_seconds = block.run(
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        kbuf.data_ptr(),
        kbuf.stride(2),
        row,
        kbuf.shape[2],
        x_out.data_ptr(),
        h_out.data_ptr(),
    )
    layer_cache.commit(1)
    if ffn_seconds:  # the block ran the layer's second half too: x_out is the layer's output
        if isinstance(mlp, HybridMoE):
            mlp.count_block_step(ffn_seconds)
        return x_out
    out = mlp(h_out)
    return x_out + (out[0] if layer.__dict__["_hetmoe_router_scores"] else out)


__all__ = ["mla_layer_eligible", "mla_parts", "one_token_mla"]
