"""A lean one-token forward for pre-norm GQA decoder layers on a CPU-only load.

A decode step of a CPU-only model spends about a millisecond a layer outside the weights, most of
it in Python: transformers' decoder layer, its attention module (a deprecation wrapper, kwargs
unpacking, the attention-interface lookup), six module calls for q/k/v and their norms. For the
case that matters most on a CPU, one token of one sequence, ``install_fast_decode`` gives each
decoder layer of a family whose adapter names it (``MoEAdapter.decode_layer``: Qwen3-MoE,
Qwen2-MoE, Mixtral, OLMoE, MiniMax-M2, GLM-4-MoE, gpt-oss, Qwen3-Next's full-attention layers) a
forward that calls the same modules' engine paths directly, in the same order and with the same
roundings as transformers' forward (the tests hold the two bit-identical over many steps). Every
other call (prefill, batches, masks, another attention implementation, autograd, hooks) runs
transformers' own forward unchanged.

It is installed only where the layer has what it reads: q/k/v fused into one engine call
(runtime/fused_linears.py), or three engine linears where their methods do not fuse (a Q4_K_M file's
attn_v in Q6_K beside Q4_K q and k: the step runs them side by side), fused norms, this project's CPU
attention. Where the cache appends in
place (runtime/kv_cache.py), the whole attention half of a layer, and its router's logits where the
adapter routes from them, are one engine call (``DecodeAttentionBlock``, csrc/decode_step.h): the
q/k norms per head, over the whole projection or none (``MoEAdapter.decode_qk_norm``), the
rotary embedding over each head's leading values (partial rotary: GLM-4-MoE, MiniMax-M2; gpt-oss's
tables of each frequency once, ``decode_rotary_tables``), gpt-oss's attention sinks and its
sliding-window layers (the step attends over the window's rows of a ``SlidingLayer``, so no mask is
needed past the window), Qwen3-Next's query gate (``decode_gated_query``: the output times
sigmoid(gate) before o_proj; that sigmoid is the engine's, within 2 ulp of torch's). Where the MoE
block routes by softmax top-k from those logits and all its experts are in one CPU engine
(``MoEAdapter.decode_routing``: Qwen3-MoE, Mixtral, OLMoE, gpt-oss), the same call runs the
rest of the layer too: the routing (csrc/routing.h, which the Python path calls as well), the
experts, the residual add; the whole layer is then one engine call (``DecodeMoEHalf``). Where it does not
(another cache), Qwen3-MoE's layers take the same steps as separate engine calls; other families
take transformers' forward.
"""

from __future__ import annotations

import functools
import itertools
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
from .adapters.base import MLAAdapter, MoEAdapter
from .adapters.routing import BlockRouting, _fp32_copy, engine_linear
from .cpu_attention import ATTENTION_NAMES, attention_forward
from .ffn_half import NO_MLP, mlp_engines, moe_in_one_call, set_ffn_half
from .fused_norms import _DTYPES, norm_rows, norm_spec
from .fused_norms import _fused_forward as fused_norm
from .fused_rope import rope
from .mla_decode import mla_layer_eligible, mla_parts, one_token_mla
from .rotary_table import rotary_at

QK_NORMS = {"none": 0, "head": 1, "projection": 2}  # csrc/decode_step.h QKNorm


@functools.cache
def _transformers() -> types.SimpleNamespace:
    """The transformers types the one-token path checks and builds, imported once (not per call:
    ``import hetmoe`` does not import transformers, and a decode step should not re-run imports)."""
    from transformers import modeling_outputs
    from transformers.cache_utils import DynamicLayer

    return types.SimpleNamespace(DynamicLayer=DynamicLayer, outputs=modeling_outputs)


def _eligible_layer(layer: nn.Module, qk_norm: str, sinks: bool) -> bool:
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        return False
    if isinstance(getattr(attn, "sinks", None), torch.Tensor) != sinks:
        return False  # sinks where the adapter says none, or none where it says some
    norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
    qk = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if qk_norm == "none" and any(n is not None for n in qk):
        return False  # norms the adapter does not expect: not the layer it describes
    return (
        (isinstance(getattr(attn, "fused_qkv_proj", None), FusedLinears) or _separate_qkv(attn) is not None)
        and isinstance(getattr(attn, "o_proj", None), CPULinear)
        and all(hasattr(n, "_hetmoe_mode") for n in norms + (qk if qk_norm != "none" else []))  # fused_norms.py
    )


def _separate_qkv(attn: nn.Module) -> tuple[CPULinear, CPULinear, CPULinear] | None:
    """q/k/v as three engine linears where they were not fused into one (their stored methods differ:
    a Q4_K_M file's attn_v in Q6_K beside Q4_K q and k); None otherwise. Read from ``_modules``, as
    ``_parts_unhooked`` reads children."""
    mods = attn._modules
    if "fused_qkv_proj" in mods:
        return None
    parts = tuple(mods.get(n) for n in ("q_proj", "k_proj", "v_proj"))
    return parts if all(isinstance(p, CPULinear) for p in parts) else None  # type: ignore[return-value]


def install_fast_decode(model: nn.Module, adapter: MoEAdapter) -> int:
    """Give every eligible decoder layer of the adapter's ``decode_layer`` class the lean one-token
    forward, and the causal LM too when all its layers have it; returns how many layers."""
    if not adapter.decodes_in_one_call() or adapter.decode_qk_norm not in QK_NORMS:
        return 0
    qk_norm = adapter.decode_qk_norm
    count = 0
    layers = []
    for layer in model.modules():
        if type(layer).__name__ != adapter.decode_layer:
            continue
        layers.append(layer)
        mla = isinstance(adapter, MLAAdapter)
        if mla_layer_eligible(layer) if mla else _eligible_layer(layer, qk_norm, adapter.decode_sinks):
            layer._hetmoe_mla = adapter if mla else None  # latent attention: models/mla_decode.py
            layer._hetmoe_qk_norm = qk_norm
            layer._hetmoe_half_tables = adapter.decode_rotary_tables == "half"
            layer._hetmoe_router_scores = adapter.returns_router_scores
            layer._hetmoe_gated = adapter.decode_gated_query
            # The step-by-step path (_one_token's second half) is Qwen3-MoE's: per-head q/k norms and
            # the fused full-head rotary of fused_rope.py.
            rotary = getattr(sys.modules[type(layer).__module__], "apply_rotary_pos_emb", None)
            fused = "fused_qkv_proj" in layer.self_attn._modules
            standard = not adapter.decode_gated_query and hasattr(rotary, "hetmoe_original")
            layer._hetmoe_steps = fused and qk_norm == "head" and standard
            layer.forward = types.MethodType(_make_forward(type(layer).forward), layer)
            count += 1
    causal = adapter.decode_causal_lm
    if layers and count == len(layers) and causal is not None and type(model).__name__ == causal[0]:
        model._hetmoe_output = getattr(_transformers().outputs, causal[1])  # the class its forward returns
        model.forward = types.MethodType(_make_causal_forward(type(model).forward), model)
    return count


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
    if window and past + 1 > window and not _windows_in_cache(model.config, layers):  # (Qwen2-MoE: 0 for none)
        return False  # transformers builds a sliding-window mask whenever the config names a window
    if attention_mask is not None and (attention_mask.shape != (1, past + 1) or not bool(attention_mask.all())):
        return False  # padding: the mask must reach the layers
    if position_ids is not None and position_ids.shape != (1, 1):
        return False
    inner = model.model
    return not (inner._forward_hooks or inner._forward_pre_hooks)


def _windows_in_cache(config: Any, layers: list[Any]) -> bool:
    """Every sliding-window layer's cache keeps only its window (transformers' sliding cache layers,
    gpt-oss), so one query over what it holds needs no mask; the other layers attend to everything."""
    types_ = getattr(config, "layer_types", None)
    if not types_ or len(types_) > len(layers):
        return False
    for kind, layer in zip(types_, layers, strict=False):
        if kind == "sliding_attention" and not getattr(layer, "is_sliding", False):
            return False
        if kind not in ("sliding_attention", "full_attention"):
            return False
    return True


def _one_token_model(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor | None, cache: Any) -> Any:
    """transformers' causal LM + model forward (Qwen3MoeForCausalLM + Qwen3MoeModel and their
    siblings) for one token without padding: the same modules in the same order (no mask is built:
    one query over a full, unpadded cache sees every key)."""
    inner = model.model
    hidden = inner.embed_tokens(input_ids)
    position = cache.get_seq_length() if position_ids is None else int(position_ids)  # _causal_fast: [1, 1]
    position_embeddings = rotary_at(inner.rotary_emb, hidden, position)
    # What _takes_fast_path checks per layer, checked once for all (_causal_fast saw the cache's layers)
    direct = inner.config._attn_implementation in ATTENTION_NAMES and not (
        hidden.requires_grad and torch.is_grad_enabled()
    )
    # the layers as a list: slicing the ModuleList would build a new ModuleList every step
    for layer in list(inner.layers._modules.values())[: inner.config.num_hidden_layers]:
        out = None
        if direct and not layer.training and _fast_installed(layer) and _parts_unhooked(layer):
            out = _one_token(layer, hidden, cache, position_embeddings)
        if out is None:
            if position_ids is None:
                position_ids = torch.tensor([[position]], device=hidden.device)
            out = layer(hidden, position_ids=position_ids, cache=cache, position_embeddings=position_embeddings)
        hidden = out
    hidden = inner.norm(hidden)
    return model._hetmoe_output(logits=model.lm_head(hidden), cache=cache)


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
        out = None
        if _takes_fast_path(self, hidden_states, attention_mask, cache, position_embeddings, kwargs):
            out = _one_token(self, hidden_states, cache, position_embeddings)
        if out is None:
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
        return out

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
    if kwargs.get("output_attentions") or layer.self_attn.config._attn_implementation not in ATTENTION_NAMES:
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
        if layer.__dict__["_hetmoe_mla"] is not None:
            parts = mla_parts(layer)
            return not any(p._forward_hooks or p._forward_pre_hooks for p in parts)
        children = layer._modules
        attn = children["self_attn"]
        separate = _separate_qkv(attn)
        if separate is None:
            group = attn._modules["fused_qkv_proj"]
            qkv = [group, group._modules["linear"]]
        else:
            qkv = list(separate)
        parts = [
            layer,
            attn,
            attn._modules["o_proj"],
            *qkv,
            children["input_layernorm"],
            children["post_attention_layernorm"],
            children["mlp"],
        ]
        if layer.__dict__["_hetmoe_qk_norm"] != "none":
            parts += [attn._modules["q_norm"], attn._modules["k_norm"]]
    except KeyError:  # a part was removed after install_fast_decode: transformers' forward
        return False
    return not any(p._forward_hooks or p._forward_pre_hooks for p in parts)


def _qk_norms_apply(attn: nn.Module, widths: tuple[int, int], dtype: torch.dtype) -> bool:
    """The engine's norm kernel takes q_norm and k_norm as they are (in their own rounding mode), over
    rows of ``widths`` (q's, k's) values in ``dtype``."""
    return dtype in _DTYPES and all(
        n.weight.dtype == dtype and n.weight.shape == (w,) and n.weight.is_contiguous()
        for n, w in zip((attn.q_norm, attn.k_norm), widths, strict=True)
    )


def _rotary_applies(cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, dtype: torch.dtype) -> bool:
    """The engine's rotary kernel takes this token's tables ``[1, 1, rotary_dim]`` as they are."""
    return (
        cos.dtype == dtype
        and sin.dtype == dtype
        and cos.shape == (1, 1, rotary_dim)
        and sin.shape == (1, 1, rotary_dim)
        and cos.is_contiguous()
        and sin.is_contiguous()
    )


def _norm_rope_direct(
    attn: nn.Module, qkv: torch.Tensor, bounds: list[int], d: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q_norm, k_norm and the rotary embedding as direct engine calls on the rows of ``qkv``, without
    the modules' per-call checks (the same kernels, so the same values); None where they do not apply."""
    dtype = qkv.dtype
    if not (qkv.is_contiguous() and _qk_norms_apply(attn, (d, d), dtype) and _rotary_applies(cos, sin, d, dtype)):
        return None
    q = qkv[..., bounds[0] : bounds[1]].view(1, -1, 1, d)  # [1, heads, 1, d]: one token's rows as they lie
    k = qkv[..., bounds[1] : bounds[2]].view(1, -1, 1, d)
    return rope(norm_rows(attn.q_norm, q), cos, sin), rope(norm_rows(attn.k_norm, k), cos, sin)


def _router_engine(mlp: nn.Module) -> Any:
    """The engine linear that computes ``mlp``'s router logits (routing.router_logits' own), where
    the block is a HybridMoE whose adapter routes from those logits alone; else None."""
    if not isinstance(mlp, HybridMoE) or not mlp.adapter.routes_from_logits(mlp):
        return None
    gate = mlp._modules.get(mlp.adapter.router_attr)
    if gate is None or gate._forward_hooks or gate._forward_pre_hooks:
        return None
    return engine_linear(gate.weight, getattr(gate, "bias", None))  # gpt-oss's router has a bias


def _attention_block(layer: nn.Module, dtype: torch.dtype, rotary_dim: int) -> tuple[Any, Any, int] | None:
    """``(engine block, router CPULinear or None, KV heads)`` running the layer's attention half for
    one token (decode_step.h), made once and again whenever a module or weight it points to is
    replaced, or a norm weight's storage is (``param.data = ...`` keeps the Parameter but frees the
    memory the block reads: so the norms' data pointers are compared too); None where the layer's
    parts do not fit it."""
    children = layer._modules  # not attribute access: see _parts_unhooked
    self_attn = children["self_attn"]
    attn = self_attn._modules
    qk = layer.__dict__["_hetmoe_qk_norm"] != "none"
    separate = _separate_qkv(self_attn)
    qkv = separate if separate is not None else (attn["fused_qkv_proj"]._modules["linear"], None, None)
    parts = (
        dtype,
        rotary_dim,
        children["input_layernorm"]._parameters["weight"],
        attn["q_norm"]._parameters["weight"] if qk else None,
        attn["k_norm"]._parameters["weight"] if qk else None,
        children["post_attention_layernorm"]._parameters["weight"],
        self_attn._parameters.get("sinks"),
        *qkv,
        attn["o_proj"],
        _router_engine(children["mlp"]),
    )
    pointers = tuple(None if p is None else p.data_ptr() for p in parts[2:7])
    cached = layer.__dict__.get("_hetmoe_decode_block")
    if (
        cached is not None
        and cached[1] == pointers
        and cached[0][:2] == parts[:2]  # dtype and rotary width: values
        and all(map(operator.is_, cached[0][2:], parts[2:]))  # weights and modules: the same objects
    ):
        return cached[2]
    made = _make_attention_block(layer, dtype, rotary_dim, parts[-1])
    layer._hetmoe_decode_block = (parts, pointers, made)
    return made


def _make_attention_block(
    layer: nn.Module, dtype: torch.dtype, rotary_dim: int, router: Any
) -> tuple[Any, Any, int, torch.Tensor | None] | None:
    attn = layer.self_attn
    separate = _separate_qkv(attn)
    d = attn.head_dim
    if separate is None:
        group: FusedLinears = attn.fused_qkv_proj
        b = group.bounds
        linears = (group.linear._engine, None, None)
    else:
        b = [0, *itertools.accumulate(m.out_features for m in separate)]
        linears = tuple(m._engine for m in separate)
    hidden = attn.o_proj.out_features
    gated = layer._hetmoe_gated  # q_proj's rows: each head's query, then its gate
    heads, kv = (b[1] - b[0]) // (2 * d if gated else d), (b[2] - b[1]) // d
    if d % 16 or b[0] != 0 or b[3] - b[2] != kv * d or not kv or heads % kv or dtype not in _DTYPES:
        return None
    inputs = [m.in_features for m in separate] if separate is not None else [attn.fused_qkv_proj.linear.in_features]
    if any(i != hidden for i in inputs):
        return None
    if rotary_dim % 2 or not 0 < rotary_dim <= d:
        return None
    qk_norm = layer._hetmoe_qk_norm
    widths = (d, d) if qk_norm == "head" else (heads * d, kv * d)
    if qk_norm != "none" and not _qk_norms_apply(attn, widths, dtype):
        return None
    if attn.o_proj.in_features != heads * d or attn.o_proj.out_features != hidden:
        return None
    for n in (layer.input_layernorm, layer.post_attention_layernorm):
        if n.weight.dtype != dtype or n.weight.shape != (hidden,) or not n.weight.is_contiguous():
            return None
    if router is not None and router.in_features != hidden:
        router = None
    sinks = getattr(attn, "sinks", None)
    if sinks is not None:
        if sinks.shape != (heads,):
            return None
        sinks = sinks.detach().float().contiguous()  # what the kernel reads: kept with the block
    absent = (0, 0.0, 0)
    qk = (absent, absent) if qk_norm == "none" else (norm_spec(attn.q_norm), norm_spec(attn.k_norm))
    norms = (norm_spec(layer.input_layernorm), *qk, norm_spec(layer.post_attention_layernorm))
    block = engine_module().DecodeAttentionBlock(
        _DTYPES[dtype],
        hidden,
        heads,
        kv,
        d,
        norms,
        float(attn.scaling),
        linears[0],
        attn.o_proj._engine,
        None if router is None else router._engine,
        qk_norm=QK_NORMS[qk_norm],
        rotary_dim=rotary_dim,
        sinks=0 if sinks is None else sinks.data_ptr(),
        k_proj=linears[1],
        v_proj=linears[2],
        gated=gated,
    )
    return block, router, kv, sinks


def whole_layer_in_one_call(mlp: nn.Module) -> bool:
    """A one-token step of a fast-decode layer with this MoE block would run it inside the layer's
    engine call as things stand (the block's router in the engine, softmax top-k routing, every
    expert in one engine; for a grouped router, ffn_half.moe_in_one_call): what models/paths.py
    reports."""
    if isinstance(mlp, HybridMoE) and _fp32_logits(mlp.adapter.decode_routing(mlp)):
        return moe_in_one_call(mlp)
    return (
        isinstance(mlp, HybridMoE)
        and _logits_routing(mlp, mlp.compute_dtype) is not None
        and _router_engine(mlp) is not None
        and mlp.one_token_in_engine()
    )


def _set_moe_half(layer: nn.Module, block: Any, router: Any, dtype: torch.dtype) -> None:
    """Give the block the layer's MoE half (csrc/decode_step.h: DecodeMoEHalf) where its HybridMoE
    routes from the block's logits as the engine's MoE half can (``_logits_routing``) and this
    step would run all of it in one CPU engine: no expert on a device, none deferred, no layerwise
    prefill, no routing being recorded (HybridMoE.forward_routed does those in Python). Otherwise
    the block ends at the logits. Set again only when what it points to changed."""
    mlp = layer._modules["mlp"]
    key = None
    spec = _logits_routing(mlp, dtype) if router is not None else None
    if spec is not None and mlp.one_token_in_engine():
        key = (block, mlp.cpu, mlp._cpu_counts, spec[3], spec[:3], *spec[4:])  # tensors by identity
    cached = layer.__dict__.get("_hetmoe_moe_half")
    if cached is key or (
        cached is not None and key is not None and all(map(operator.is_, cached[:4], key[:4])) and cached[4:] == key[4:]
    ):
        return
    if key is None:
        block.set_moe(None)
    else:
        k, normalize, rounded, bias, shared, gate = spec
        cpu, counts = mlp.cpu, mlp._cpu_counts
        block.set_moe(cpu._engine, cpu._mask.data_ptr(), k, normalize, rounded and dtype == torch.bfloat16,
                      counts.data_ptr(), 0 if bias is None else bias.data_ptr(), shared, gate)  # fmt: skip
    layer._hetmoe_moe_half = key


def _fp32_logits(routing: BlockRouting | None) -> bool:
    """A block routed by a grouped router on fp32 logits (DeepSeek, GLM): ffn_half.py's to run."""
    return routing is not None and routing.fp32 and routing.grouped is not None


def _shared_engines(routing: BlockRouting) -> tuple[tuple[Any, ...], Any] | None:
    """``(MLP engines, gate engine or None)`` of the block's shared experts, ffn_half's NO_MLP where
    there are none; None where they do not run in the engine as the module path runs them (the gate
    a bf16 router in the engine, routing.engine_linear, as gated_shared_expert takes it)."""
    if routing.shared is None:
        return NO_MLP, None
    engines = mlp_engines(routing.shared)
    if engines is None:
        return None
    gate = routing.shared_gate
    if gate is None:
        return engines, None
    linear = engine_linear(gate.weight, getattr(gate, "bias", None))
    return None if linear is None else (engines, linear._engine)


def _logits_routing(mlp: nn.Module, dtype: torch.dtype) -> tuple[Any, ...] | None:
    """``(k, normalize, round, bias, shared engines, shared gate engine)`` where the HybridMoE routes
    from the block's logits (``MoEAdapter.decode_routing``, not on fp32 logits) as the engine's MoE
    half can, its shared experts in the engine (``_shared_engines``): softmax top-k (bias None), or a
    sigmoid router in one group, renormalised, unscaled (MiniMax-M2), on logits of its router's
    dtype, its bias in fp32 (the copy the adapter's routing reads too, routing._fp32_copy). Else None."""
    if not isinstance(mlp, HybridMoE):
        return None
    routing = mlp.adapter.decode_routing(mlp)
    if routing is None or routing.fp32:
        return None
    shared = _shared_engines(routing)
    if shared is None:
        return None
    if routing.softmax is not None:
        return (*routing.softmax, None, *shared)
    spec, bias = routing.grouped, routing.bias
    if spec is None or not (spec.sigmoid and spec.n_group == 1 and spec.eps == 0 and spec.scaling == 1):
        return None
    gate = mlp._modules.get("gate")
    if gate is None or gate._parameters["weight"].dtype != dtype:
        return None
    if bias is not None and (bias.device.type != "cpu" or bias.shape != (mlp.cpu.experts,)):
        return None
    return spec.k, spec.normalize, False, None if bias is None else _fp32_copy(bias), *shared


def _one_token_block(layer: nn.Module, x: torch.Tensor, cache: Any, position_embeddings: Any) -> torch.Tensor | None:
    """The layer for one token with its attention half as one engine call (the router's logits too,
    where the MoE block routes from them): the same kernels in the same order as ``_one_token``'s
    separate calls, so the same values. None where it does not apply."""
    attn = layer._modules["self_attn"]
    if not x.is_contiguous():
        return None
    dtype = x.dtype
    cos, sin = position_embeddings
    if layer.__dict__["_hetmoe_half_tables"]:  # each frequency once: the layout rotate_half reads
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    rotary_dim = cos.shape[-1]
    made = _attention_block(layer, dtype, rotary_dim)
    if made is None or x.numel() != attn._modules["o_proj"].out_features:
        return None
    block, router, kv_heads, _ = made
    d = attn.head_dim
    if not _rotary_applies(cos, sin, rotary_dim, dtype):
        return None
    layer_cache = cache.layers[attn.layer_idx]
    free_row = getattr(layer_cache, "free_row", None)
    free = free_row(kv_heads, d, dtype) if free_row is not None else None
    if free is None:
        return None
    row, kbuf, vbuf, first = free
    window = getattr(attn, "sliding_window", None)
    if window:  # the token sees itself and the window - 1 before it, whatever the cache keeps
        first = max(first, row + 1 - window)
    hidden = x.shape[-1]
    x_out = torch.empty(1, 1, hidden, dtype=dtype)
    h_out = torch.empty(1, hidden, dtype=dtype)
    logits = None if router is None else torch.empty(1, router.out_features, dtype=dtype)
    mlp = layer._modules["mlp"]
    if router is None:  # the rest of the layer from h_out, where the block can run it (ffn_half.py)
        set_ffn_half(layer, mlp, block)
    else:
        _set_moe_half(layer, block, router, dtype)
    moe_seconds = block.run(
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
        first,
    )
    layer_cache.commit(1)
    if moe_seconds:  # the block ran the layer's second half too: x_out is the layer's output
        if isinstance(mlp, HybridMoE):  # (else a dense MLP)
            mlp.count_block_step(moe_seconds)
        return x_out
    routed = None if logits is None else mlp.adapter.route_logits(mlp, logits)
    if routed is None:  # no logits, or the adapter does not route from these after all
        out = mlp(h_out.view(1, 1, hidden))
        return x_out + (out[0] if layer.__dict__["_hetmoe_router_scores"] else out)
    return x_out + mlp.forward_routed(h_out, *routed).view(1, 1, hidden)


def _one_token(layer: nn.Module, x: torch.Tensor, cache: Any, position_embeddings: Any) -> torch.Tensor | None:
    """transformers' decoder layer + attention forward for one token, the same ops in the same order,
    called directly: the engine block, else (Qwen3-MoE) the same steps one call each; None where
    neither applies (the caller runs transformers' forward)."""
    mla = layer.__dict__["_hetmoe_mla"]
    if mla is not None:
        return one_token_mla(layer, mla, x, cache, position_embeddings)
    out = _one_token_block(layer, x, cache, position_embeddings)
    if out is not None or not layer.__dict__["_hetmoe_steps"]:
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
