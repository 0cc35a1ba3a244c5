"""A lean one-token forward for Qwen3-MoE decoder layers on a CPU-only load.

A decode step of a CPU-only model spends about a millisecond a layer outside the weights, most of
it in Python: transformers' decoder layer, its attention module (a deprecation wrapper, kwargs
unpacking, the attention-interface lookup), six module calls for q/k/v and their norms. For the
case that matters most on a CPU, one token of one sequence, ``install_fast_decode`` gives each
Qwen3-MoE decoder layer a forward that calls the same modules' engine paths directly, in the same
order and with the same roundings as transformers' forward (the tests hold the two bit-identical
over many steps). Every other call (prefill, batches, masks, another attention implementation,
autograd, hooks) runs transformers' own forward unchanged.

It is installed only where the layer has what it reads: q/k/v fused into one engine call
(runtime/fused_linears.py), fused norms and rotary embedding, this project's CPU attention.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch import nn

from ..kernels.dispatch import engine_module
from ..runtime.cpu_linear import CPULinear
from ..runtime.fused_linears import FusedLinears
from .cpu_attention import ATTENTION_NAME, attention_forward
from .fused_norms import _fused_forward as fused_norm

_LAYER_CLASSES = ("Qwen3MoeDecoderLayer",)


def _eligible_layer(layer: nn.Module) -> bool:
    attn = getattr(layer, "self_attn", None)
    if type(layer).__name__ not in _LAYER_CLASSES or attn is None:
        return False
    norms = (layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm)
    return (
        isinstance(getattr(attn, "fused_qkv_proj", None), FusedLinears)
        and isinstance(attn.o_proj, CPULinear)
        and all(hasattr(n, "_hetmoe_mode") for n in norms)  # fused_norms.py installed
        and hasattr(sys.modules[type(layer).__module__].apply_rotary_pos_emb, "hetmoe_original")  # fused_rope.py
    )


def install_fast_decode(model: nn.Module) -> int:
    """Give every eligible decoder layer the lean one-token forward; returns how many."""
    count = 0
    for layer in model.modules():
        if _eligible_layer(layer):
            layer.forward = types.MethodType(_make_forward(type(layer).forward), layer)
            count += 1
    return count


def _make_forward(original: Any) -> Any:
    def forward(
        self: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)  # the name transformers deprecates
        if not _takes_fast_path(self, hidden_states, attention_mask, cache, position_embeddings, kwargs):
            return original(
                self,
                hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        return _one_token(self, hidden_states, cache, position_embeddings)

    return forward


def _takes_fast_path(
    layer: nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    cache: Any,
    position_embeddings: Any,
    kwargs: dict[str, Any],
) -> bool:
    from transformers.cache_utils import DynamicLayer

    if layer.training or mask is not None or position_embeddings is None or cache is None:
        return False
    if x.device.type != "cpu" or x.dim() != 3 or x.shape[0] != 1 or x.shape[1] != 1:
        return False
    if torch.is_grad_enabled() and x.requires_grad:
        return False
    if kwargs.get("output_attentions") or layer.self_attn.config._attn_implementation != ATTENTION_NAME:
        return False
    layers = getattr(cache, "layers", None)
    idx = layer.self_attn.layer_idx
    if layers is None or idx >= len(layers) or not isinstance(layers[idx], DynamicLayer):
        return False
    # hooks on the layer's parts would be skipped by the direct calls below
    attn = layer.self_attn
    parts = (layer, attn, attn.q_norm, attn.k_norm, attn.o_proj, layer.input_layernorm, layer.post_attention_layernorm)
    return not any(p._forward_hooks or p._forward_pre_hooks for p in parts)


_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _norm_rope_direct(
    attn: nn.Module, qkv: torch.Tensor, bounds: list[int], d: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q_norm, k_norm and the rotary embedding as four engine calls on the rows of ``qkv`` in place of
    the modules' forwards (the same kernels, so the same values); None where they do not apply."""
    dtype = qkv.dtype
    norms = (attn.q_norm, attn.k_norm)
    if (
        dtype not in _DTYPES
        or not qkv.is_contiguous()
        or any(n.weight.dtype != dtype or n.weight.shape[0] != d or n._hetmoe_mode != 0 for n in norms)
        or cos.dtype != dtype
        or sin.dtype != dtype
        or cos.shape != (1, 1, d)
        or sin.shape != (1, 1, d)
        or not (cos.is_contiguous() and sin.is_contiguous())
    ):
        return None
    engine = engine_module()
    code, size = _DTYPES[dtype], qkv.element_size()
    out = []
    for i, norm in enumerate(norms):
        heads = (bounds[i + 1] - bounds[i]) // d
        normed = torch.empty(1, heads, 1, d, dtype=dtype)
        weight = norm.weight.detach()
        engine.rms_norm(
            qkv.data_ptr() + bounds[i] * size, weight.data_ptr(), normed.data_ptr(), code, heads, d,
            norm._hetmoe_eps, norm._hetmoe_mode,
        )  # fmt: skip
        rotated = torch.empty_like(normed)
        engine.rope(normed.data_ptr(), cos.data_ptr(), sin.data_ptr(), rotated.data_ptr(), code, 1, heads, 1, d, True)
        out.append(rotated)
    return out[0], out[1]


def _one_token(layer: nn.Module, x: torch.Tensor, cache: Any, position_embeddings: Any) -> torch.Tensor:
    """transformers' Qwen3MoeDecoderLayer + Qwen3MoeAttention forward for one token, the same ops in
    the same order, called directly."""
    attn = layer.self_attn
    modeling = sys.modules[type(layer).__module__]
    d = attn.head_dim
    h = fused_norm(layer.input_layernorm, x)
    group: FusedLinears = attn.fused_qkv_proj
    qkv = group.linear(h)
    b = group.bounds
    cos, sin = position_embeddings
    v = qkv[..., b[2] : b[3]].view(1, 1, -1, d).transpose(1, 2)
    direct = _norm_rope_direct(attn, qkv, b, d, cos, sin)
    if direct is not None:
        q, k = direct
    else:
        q = fused_norm(attn.q_norm, qkv[..., b[0] : b[1]].view(1, 1, -1, d)).transpose(1, 2)
        k = fused_norm(attn.k_norm, qkv[..., b[1] : b[2]].view(1, 1, -1, d)).transpose(1, 2)
        q, k = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    k, v = cache.update(k, v, attn.layer_idx)
    out, _ = attention_forward(
        attn, q, k, v, None, dropout=0.0, scaling=attn.scaling, sliding_window=attn.sliding_window
    )
    out = attn.o_proj(out.reshape(1, 1, -1).contiguous())
    x = x + out
    return x + layer.mlp(fused_norm(layer.post_attention_layernorm, x))
