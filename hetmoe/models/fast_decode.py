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
(runtime/fused_linears.py), fused norms and rotary embedding, this project's CPU attention. Where
the cache appends in place (runtime/kv_cache.py), the whole attention half of a layer and its
router's logits are one engine call (``DecodeAttentionBlock``, csrc/decode_step.h).
"""

from __future__ import annotations

import functools
import operator
import sys
import types
from typing import Any

import torch
from torch import nn

from ..kernels.dispatch import engine_module
from ..runtime.cpu_linear import CPULinear
from ..runtime.fused_linears import FusedLinears
from ..runtime.hybrid import HybridMoE
from .adapters.base import MoEAdapter
from .adapters.routing import engine_linear
from .cpu_attention import ATTENTION_NAME, attention_forward
from .fused_norms import _DTYPES, norm_rows
from .fused_norms import _fused_forward as fused_norm
from .fused_rope import rope

_LAYER_CLASSES = ("Qwen3MoeDecoderLayer",)


@functools.cache
def _transformers() -> types.SimpleNamespace:
    """The transformers types the one-token path checks and builds, imported once (not per call:
    ``import hetmoe`` does not import transformers, and a decode step should not re-run imports)."""
    from transformers.cache_utils import DynamicLayer
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    return types.SimpleNamespace(DynamicLayer=DynamicLayer, MoeCausalLMOutputWithPast=MoeCausalLMOutputWithPast)


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
    """Give every eligible decoder layer the lean one-token forward, and the causal LM too when all its
    layers have it; returns how many layers."""
    count = 0
    layers = []
    for layer in model.modules():
        if type(layer).__name__ in _LAYER_CLASSES:
            layers.append(layer)
        if _eligible_layer(layer):
            layer.forward = types.MethodType(_make_forward(type(layer).forward), layer)
            count += 1
    if layers and count == len(layers) and type(model).__name__ in _CAUSAL_CLASSES:
        model.forward = types.MethodType(_make_causal_forward(type(model).forward), model)
    return count


_CAUSAL_CLASSES = ("Qwen3MoeForCausalLM",)
# keyword arguments the one-token model forward may ignore (what generate passes besides the inputs)
_IGNORABLE = {"cache_position", "return_dict", "output_attentions", "output_hidden_states"}


def _make_causal_forward(original: Any) -> Any:
    def forward(
        self: nn.Module,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> Any:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if not _causal_fast(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels,
                            output_router_logits, logits_to_keep, kwargs):  # fmt: skip
            return original(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                inputs_embeds=inputs_embeds,
                labels=labels,
                use_cache=use_cache,
                output_router_logits=output_router_logits,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        return _one_token_model(self, input_ids, position_ids, cache)

    return forward


def _causal_fast(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Any,
    inputs_embeds: torch.Tensor | None,
    labels: torch.Tensor | None,
    output_router_logits: bool | None,
    logits_to_keep: Any,
    kwargs: dict[str, Any],
) -> bool:
    """One token of one sequence continuing a cache, nothing asked beyond the logits."""
    if model.training or inputs_embeds is not None or labels is not None or input_ids is None or cache is None:
        return False
    if input_ids.shape != (1, 1) or input_ids.device.type != "cpu":
        return False
    if output_router_logits or model.config.output_router_logits or not isinstance(logits_to_keep, int):
        return False
    if any(k not in _IGNORABLE for k in kwargs) or kwargs.get("return_dict") is False:
        return False
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return False
    layers = getattr(cache, "layers", None)
    if not layers or not all(isinstance(layer, _transformers().DynamicLayer) for layer in layers):
        return False
    past = cache.get_seq_length()
    window = getattr(model.config, "sliding_window", None)
    if window is not None and past + 1 > window:
        return False  # transformers builds a sliding-window mask whenever the config names a window
    if attention_mask is not None and (attention_mask.shape != (1, past + 1) or not bool(attention_mask.all())):
        return False  # padding: the mask must reach the layers
    if position_ids is not None and position_ids.shape != (1, 1):
        return False
    inner = model.model
    return not (inner._forward_hooks or inner._forward_pre_hooks)


def _one_token_model(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None, cache: Any) -> Any:
    """transformers' Qwen3MoeForCausalLM + Qwen3MoeModel forward for one token without padding: the
    same modules in the same order (no mask is built: one query over a full, unpadded cache sees
    every key)."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    if position_ids is None:
        position_ids = (torch.arange(1, device=hidden.device) + cache.get_seq_length()).unsqueeze(0)
    position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
    # What _takes_fast_path checks per layer, checked once for all (_causal_fast saw the cache's layers)
    direct = inner.config._attn_implementation == ATTENTION_NAME and not (
        hidden.requires_grad and torch.is_grad_enabled()
    )
    for layer in inner.layers[: inner.config.num_hidden_layers]:
        if direct and not layer.training and _fast_installed(layer) and _parts_unhooked(layer):
            hidden = _one_token(layer, hidden, cache, position_embeddings)
        else:
            hidden = layer(hidden, position_ids=position_ids, cache=cache, position_embeddings=position_embeddings)
    hidden = inner.norm(hidden)
    return _transformers().MoeCausalLMOutputWithPast(logits=model.lm_head(hidden), cache=cache)


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

    forward.hetmoe_fast_decode = True  # type: ignore[attr-defined]
    return forward


def _takes_fast_path(
    layer: nn.Module,
    x: torch.Tensor,
    mask: torch.Tensor | None,
    cache: Any,
    position_embeddings: Any,
    kwargs: dict[str, Any],
) -> bool:
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
    if layers is None or idx >= len(layers) or not isinstance(layers[idx], _transformers().DynamicLayer):
        return False
    return _parts_unhooked(layer)


def _fast_installed(layer: nn.Module) -> bool:
    """The layer's forward is still the one install_fast_decode gave it."""
    return getattr(layer.__dict__.get("forward"), "hetmoe_fast_decode", False)


def _parts_unhooked(layer: nn.Module) -> bool:
    """No forward hooks on the modules the one-token path calls directly (the hooks would be skipped).
    Children are read from ``_modules`` itself: ``nn.Module.__getattr__`` cost ~0.6 us an attribute,
    and a decode step reads dozens."""
    try:
        children = layer._modules
        attn = children["self_attn"]
        group = attn._modules["fused_qkv_proj"]
        parts = (
            layer,
            attn,
            attn._modules["q_norm"],
            attn._modules["k_norm"],
            attn._modules["o_proj"],
            group,
            group._modules["linear"],
            children["input_layernorm"],
            children["post_attention_layernorm"],
            children["mlp"],
        )
    except KeyError:  # a part was removed after install_fast_decode: transformers' forward
        return False
    return not any(p._forward_hooks or p._forward_pre_hooks for p in parts)


def _qk_norms_apply(attn: nn.Module, d: int, dtype: torch.dtype) -> bool:
    """The engine's norm kernel takes q_norm and k_norm as they are, for rows of ``d`` in ``dtype``."""
    return dtype in _DTYPES and all(
        n.weight.dtype == dtype and n.weight.shape == (d,) and n.weight.is_contiguous() and n._hetmoe_mode == 0
        for n in (attn.q_norm, attn.k_norm)
    )


def _rotary_applies(cos: torch.Tensor, sin: torch.Tensor, d: int, dtype: torch.dtype) -> bool:
    """The engine's rotary kernel takes this token's tables ``[1, 1, d]`` as they are."""
    return (
        cos.dtype == dtype
        and sin.dtype == dtype
        and cos.shape == (1, 1, d)
        and sin.shape == (1, 1, d)
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def _norm_rope_direct(
    attn: nn.Module, qkv: torch.Tensor, bounds: list[int], d: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q_norm, k_norm and the rotary embedding as direct engine calls on the rows of ``qkv``, without
    the modules' per-call checks (the same kernels, so the same values); None where they do not apply."""
    dtype = qkv.dtype
    if not (qkv.is_contiguous() and _qk_norms_apply(attn, d, dtype) and _rotary_applies(cos, sin, d, dtype)):
        return None
    q = qkv[..., bounds[0] : bounds[1]].view(1, -1, 1, d)  # [1, heads, 1, d]: one token's rows as they lie
    k = qkv[..., bounds[1] : bounds[2]].view(1, -1, 1, d)
    return rope(norm_rows(attn.q_norm, q), cos, sin), rope(norm_rows(attn.k_norm, k), cos, sin)


def _router_engine(mlp: nn.Module) -> Any:
    """The engine linear that computes ``mlp``'s router logits (routing.router_logits' own), where
    the block is a HybridMoE whose adapter routes from those logits alone; else None."""
    if not isinstance(mlp, HybridMoE) or type(mlp.adapter).route_logits is MoEAdapter.route_logits:
        return None
    gate = mlp._modules.get("gate")
    if gate is None or gate._forward_hooks or gate._forward_pre_hooks:
        return None
    return engine_linear(gate.weight, None)


def _attention_block(layer: nn.Module, dtype: torch.dtype) -> tuple[Any, Any, int] | None:
    """``(engine block, router CPULinear or None, KV heads)`` running the layer's attention half for
    one token (decode_step.h), made once and again whenever a module or weight it points to is
    replaced, or a norm weight's storage is (``param.data = ...`` keeps the Parameter but frees the
    memory the block reads: so the norms' data pointers are compared too); None where the layer's
    parts do not fit it."""
    children = layer._modules  # not attribute access: see _parts_unhooked
    attn = children["self_attn"]._modules
    parts = (
        dtype,
        children["input_layernorm"]._parameters["weight"],
        attn["q_norm"]._parameters["weight"],
        attn["k_norm"]._parameters["weight"],
        children["post_attention_layernorm"]._parameters["weight"],
        attn["fused_qkv_proj"]._modules["linear"],
        attn["o_proj"],
        _router_engine(children["mlp"]),
    )
    pointers = tuple(None if p is None else p.data_ptr() for p in parts[1:5])
    cached = layer.__dict__.get("_hetmoe_decode_block")
    if cached is not None and cached[1] == pointers and all(map(operator.is_, cached[0], parts)):
        return cached[2]
    made = _make_attention_block(layer, dtype, parts[-1])
    layer._hetmoe_decode_block = (parts, pointers, made)
    return made


def _make_attention_block(layer: nn.Module, dtype: torch.dtype, router: Any) -> tuple[Any, Any, int] | None:
    attn = layer.self_attn
    group: FusedLinears = attn.fused_qkv_proj
    d, b = attn.head_dim, group.bounds
    hidden = group.linear.in_features
    heads, kv = (b[1] - b[0]) // d, (b[2] - b[1]) // d
    norms = (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm)
    if d % 16 or b[0] != 0 or b[3] - b[2] != kv * d or not kv or heads % kv or not _qk_norms_apply(attn, d, dtype):
        return None
    if attn.o_proj.in_features != heads * d or attn.o_proj.out_features != hidden:
        return None
    for n in (layer.input_layernorm, layer.post_attention_layernorm):
        if n.weight.dtype != dtype or n.weight.shape != (hidden,) or not n.weight.is_contiguous():
            return None
    if router is not None and router.in_features != hidden:
        router = None
    block = engine_module().DecodeAttentionBlock(
        _DTYPES[dtype],
        hidden,
        heads,
        kv,
        d,
        tuple((n.weight.data_ptr(), n._hetmoe_eps, n._hetmoe_mode) for n in norms),
        float(attn.scaling),
        group.linear._engine,
        attn.o_proj._engine,
        None if router is None else router._engine,
    )
    return block, router, kv


def _one_token_block(layer: nn.Module, x: torch.Tensor, cache: Any, position_embeddings: Any) -> torch.Tensor | None:
    """The layer for one token with its attention half as one engine call (the router's logits too,
    where the MoE block routes from them): the same kernels in the same order as ``_one_token``'s
    separate calls, so the same values. None where it does not apply."""
    attn = layer._modules["self_attn"]
    if not x.is_contiguous():
        return None
    dtype = x.dtype
    made = _attention_block(layer, dtype)
    if made is None or x.numel() != attn._modules["o_proj"].out_features:
        return None
    block, router, kv_heads = made
    cos, sin = position_embeddings
    d = attn.head_dim
    if not _rotary_applies(cos, sin, d, dtype):
        return None
    layer_cache = cache.layers[attn.layer_idx]
    free_row = getattr(layer_cache, "free_row", None)
    free = free_row(kv_heads, d, dtype) if free_row is not None else None
    if free is None:
        return None
    row, kbuf, vbuf = free
    hidden = x.shape[-1]
    x_out = torch.empty(1, 1, hidden, dtype=dtype)
    h_out = torch.empty(1, hidden, dtype=dtype)
    logits = None if router is None else torch.empty(1, router.out_features, dtype=dtype)
    block.run(
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        kbuf.data_ptr(),
        vbuf.data_ptr(),
        kbuf.stride(1),  # [1, heads, capacity, D]: head and row strides, unit stride along D
        kbuf.stride(2),
        vbuf.stride(1),
        vbuf.stride(2),
        row,
        kbuf.shape[2],
        x_out.data_ptr(),
        h_out.data_ptr(),
        0 if logits is None else logits.data_ptr(),
    )
    layer_cache.commit(1)
    mlp = layer._modules["mlp"]
    if logits is None:
        return x_out + mlp(h_out.view(1, 1, hidden))
    weights, ids = mlp.adapter.route_logits(mlp, logits)
    return x_out + mlp.forward_routed(h_out, weights, ids).view(1, 1, hidden)


def _one_token(layer: nn.Module, x: torch.Tensor, cache: Any, position_embeddings: Any) -> torch.Tensor:
    """transformers' Qwen3MoeDecoderLayer + Qwen3MoeAttention forward for one token, the same ops in
    the same order, called directly."""
    out = _one_token_block(layer, x, cache, position_embeddings)
    if out is not None:
        return out
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
