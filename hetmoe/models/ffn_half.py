"""The second half of a decoder layer inside its one-call decode step (csrc/decode_step.h: DecodeFFN).

After the attention half, a one-call block (models/fast_decode.py's DecodeAttentionBlock,
models/mla_decode.py's DecodeMLABlock) can run the rest of the layer too, without returning to
Python: a dense layer's SwiGLU MLP (``DecodeMLP``), or a MoE block routed by a grouped router
(DeepSeek-V2/V3, Kimi-K2, GLM-4.x: ``MoEAdapter.decode_routing``) from fp32 logits, its routed
experts in the CPU engine and its shared experts an engine MLP. Everything it calls is what the
module-by-module forward calls (the adapters' routing is the engine's, routing.py; the engine MLPs'
activation is runtime/engine_activations.py's), so the two give the same values; tests/test_mla_decode.py and
tests/test_fast_decode.py hold them bit-identical.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..runtime.cpu_linear import CPULinear
from ..runtime.engine_activations import EngineSiLU
from ..runtime.fused_linears import FusedSlice
from ..runtime.hybrid import HybridMoE
from .adapters.base import MLAAdapter
from .adapters.routing import _fp32_copy, engine_linear, fp32_router_in_engine

NO_MLP = (None, None, None, None)


def mlp_engines(mlp: nn.Module) -> tuple[Any, Any, Any, Any] | None:
    """``(gate_up, gate, up, down)`` engines of a SwiGLU MLP whose linears run in the engine (gate and
    up fused or apart) and whose activation is the engine's (runtime/engine_activations.py), nothing hooked:
    csrc/decode_step.h's DecodeMLP computes it with the same calls. None otherwise."""
    mods = mlp._modules
    act, gate, up, down = mods.get("act_fn"), mods.get("gate_proj"), mods.get("up_proj"), mods.get("down_proj")
    if not isinstance(act, EngineSiLU) or not isinstance(down, CPULinear):
        return None
    parts = [mlp, act, gate, up, down]
    if isinstance(gate, FusedSlice) and isinstance(up, FusedSlice):
        group = gate._group[0]
        if up._group[0] is not group or (gate.member, up.member) != (0, 1) or len(group.bounds) != 3:
            return None
        parts += [group, group.linear]
        engines = (group.linear._engine, None, None, down._engine)
    elif isinstance(gate, CPULinear) and isinstance(up, CPULinear):
        engines = (None, gate._engine, up._engine, down._engine)
    else:
        return None
    if any(p._forward_hooks or p._forward_pre_hooks for p in parts):
        return None
    return engines


def _moe_half(mlp: nn.Module) -> tuple[Any, ...] | None:
    """What the block needs to run a HybridMoE whose adapter routes by a grouped router from fp32
    logits (``MoEAdapter.decode_routing``), every routed expert in its CPU engine
    (HybridMoE.one_token_in_engine), its router in the engine as routing.router_logits computes it
    (a bf16 engine linear, or an fp32 weight through router_logits_f32) and its shared experts (if
    any, ungated) an engine MLP: ``(router engine or None, fp32 weight or None, its data pointer or 0,
    spec, fp32 bias or None, shared engines)``; None otherwise."""
    if not isinstance(mlp, HybridMoE) or not mlp.one_token_in_engine():
        return None
    routing = mlp.adapter.decode_routing(mlp)
    if routing is None or not routing.fp32 or routing.grouped is None or routing.shared_gate is not None:
        return None
    gate = mlp._modules.get("gate")
    if gate is None or gate._forward_hooks or gate._forward_pre_hooks:
        return None
    weight = gate._parameters["weight"]
    router = engine_linear(weight, None)
    f32 = weight if router is None and fp32_router_in_engine(weight, None) else None
    spec, bias = routing.grouped, routing.bias
    if (router is None and f32 is None) or (bias is not None and (bias.device.type != "cpu" or bias.dim() != 1)):
        return None
    engines = NO_MLP if routing.shared is None else mlp_engines(routing.shared)
    if engines is None:
        return None
    # the fp32 weight's storage too: a weight replaced in place keeps the tensor, not the pointer
    return router, f32, 0 if f32 is None else f32.data_ptr(), spec, None if bias is None else _fp32_copy(bias), engines


def moe_in_one_call(mlp: nn.Module) -> bool:
    """A one-token step of a layer with this MoE block would run it inside the layer's engine call as
    things stand (what models/paths.py reports; a latent-attention layer's step is bf16 only)."""
    if not isinstance(mlp, HybridMoE) or _moe_half(mlp) is None:
        return False
    return mlp.compute_dtype == torch.bfloat16 or not isinstance(mlp.adapter, MLAAdapter)


def mlp_in_one_call(mlp: nn.Module | None) -> bool:
    """A dense MLP a one-call block would run inside the layer's engine call (what models/paths.py
    reports)."""
    return mlp is not None and not isinstance(mlp, HybridMoE) and mlp_engines(mlp) is not None


def _same(a: Any, b: Any) -> bool:
    """Tensors (counts, weights, biases) by identity, the rest (spec, pointers, engine tuples) by value."""
    return a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)


def set_ffn_half(layer: nn.Module, mlp: nn.Module, block: Any) -> None:
    """Give a one-call block (DecodeAttentionBlock or DecodeMLABlock) the layer's second half where it
    can run it (csrc/decode_step.h: DecodeFFN; else the block ends at h_out and Python runs ``mlp``),
    set again only when what it points to changed. An expert on a device, deferred experts,
    layerwise prefill and recorded routing keep the MoE half in Python (HybridMoE.forward_routed
    does those)."""
    moe = _moe_half(mlp)
    if moe is not None:
        router, f32, f32_ptr, spec, bias, shared = moe
        key: tuple[Any, ...] | None = (block, mlp.cpu, mlp._cpu_counts, router, f32, f32_ptr, spec, bias, shared)
    else:
        dense = None if isinstance(mlp, HybridMoE) else mlp_engines(mlp)
        key = None if dense is None else (block, dense)
    cached = layer.__dict__.get("_hetmoe_ffn_half")
    if cached is key or (cached is not None and key is not None and len(cached) == len(key)
                         and all(map(_same, cached, key))):  # fmt: skip
        return
    block.set_ffn_moe(None, 0, None)
    block.set_ffn_mlp(NO_MLP)
    if moe is not None:
        cpu = mlp.cpu
        block.set_ffn_moe(
            router, f32_ptr, cpu._engine, cpu._mask.data_ptr(), spec.k, spec.sigmoid,
            0 if bias is None else bias.data_ptr(), spec.n_group, spec.topk_group, spec.group_by_max,
            spec.masked_zero, spec.normalize, spec.eps, spec.scaling, mlp._cpu_counts.data_ptr(), shared,
        )  # fmt: skip
    elif key is not None:
        block.set_ffn_mlp(dense)
    layer._hetmoe_ffn_half = key


__all__ = ["NO_MLP", "mlp_engines", "mlp_in_one_call", "moe_in_one_call", "set_ffn_half"]
