"""prepare_model: turn a transformers MoE model in memory into one that fine-tunes with its routed
experts in the CPU engine.

For each sparse MoE block (found by the architecture adapter): read its experts
(``extract.extract_experts``: fused, gpt-oss, per-expert lists, PEFT-wrapped, parametrized,
ZeRO-3 gathered), put them in ``method`` (bf16 keeps them exactly; int8/int4/... quantize one
expert at a time), build the CPU engine over them, replace the model's expert parameters with
zero-storage placeholders under their own names, and swap in an ``SFTMoE``. The inventory of
placeholders is recorded for ``placeholders(model)``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..models.adapters import MoEAdapter, get_adapter
from .block import SFTMoE
from .extract import ExtractedExperts, Source, extract_experts
from .frozen import FrozenExperts, activation_name, engine_for, quantize_stacked
from .hosts import RoutedExperts, host_names
from .placeholders import make_placeholder, record_inventory, replace_parameter, unwrap
from .zero3 import GatherFn


def layer_index(name: str) -> int:
    m = re.search(r"\.(\d+)\.", f".{name}.")
    if m is None:
        raise ValueError(f"{name}: cannot tell the decoder layer index from the module name")
    return int(re.findall(r"\.(\d+)\.", f".{name}.")[-1])


def frozen_from(
    ex: ExtractedExperts, method: str, group_size: int | None, adapter: MoEAdapter, use_engine: bool, where: str
) -> FrozenExperts:
    gate = quantize_stacked(ex.gate, method, group_size, f"{where}.gate")
    up = quantize_stacked(ex.up, method, group_size, f"{where}.up")
    down = quantize_stacked(ex.down, method, group_size, f"{where}.down")
    biases = {k: v.detach().float().clone() for k, v in ex.biases.items()}
    engine = engine_for(gate, up, down, adapter, biases) if use_engine else None
    return FrozenExperts(gate, up, down, adapter.activation, activation_name(adapter), biases, engine)


def _routed(ex: ExtractedExperts, experts: nn.Module, adapter: MoEAdapter, where: str) -> RoutedExperts:
    if ex.layout == "per_expert":
        return RoutedExperts(list(experts.children()), ex.names)
    e, i, h = ex.gate.shape
    dtype = ex.sources[0].dtype
    routed = RoutedExperts.weightless(e, h, i, host_names(adapter.name), dtype, where)
    # The fused parameters' placeholders move with the experts to RoutedExperts, same local names.
    ex.sources = [Source(routed, s.local, s.name, s.shape, s.dtype) for s in ex.sources]
    return routed


def prepare_model(
    model: nn.Module,
    method: str = "bf16",
    *,
    group_size: int | None = None,
    recompute: bool = False,
    use_engine: bool = True,
    gather: GatherFn | None = None,
) -> Any:
    """Prepare ``model`` (a transformers MoE causal LM, or a PEFT model around one) in place; returns it.

    ``method``: the experts' CPU precision (bf16, int8, int4, fp8, ... any codec; ``group_size`` for
    the grouped ones). ``recompute``: recompute the experts' gate/up in backward instead of saving
    them. ``use_engine``: let the compiled engine run the forward of layers without expert LoRA.
    ``gather``: a ZeRO-3 gather context factory (default: deepspeed's when installed).
    """
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    if config is None:
        raise ValueError(f"{type(inner).__name__}: expected a transformers model with a .config")
    adapter = get_adapter(config)
    blocks = [(n, m) for n, m in inner.named_modules() if adapter.is_moe_block(m)]
    if not blocks:
        found = sorted({type(m).__name__ for m in inner.modules() if isinstance(m, SFTMoE)})
        hint = " (it is already prepared)" if found else ""
        raise ValueError(f"{type(inner).__name__}: no {' or '.join(adapter.block_classes)} block to prepare{hint}")
    for name, block in blocks:
        where = f"{name}.experts"
        experts = block.experts
        ex = extract_experts(experts, where + ".", gather)
        frozen = frozen_from(ex, method, group_size, adapter, use_engine, where)
        routed = _routed(ex, experts, adapter, where)
        for s in ex.sources:
            replace_parameter(s.owner, s.local, s.name, s.shape, s.dtype)
        del ex, experts
        sft = SFTMoE(block, adapter, layer_index(name), frozen, routed, recompute=recompute, use_engine=use_engine)
        parent_name, _, attr = name.rpartition(".")
        setattr(inner.get_submodule(parent_name) if parent_name else inner, attr, sft)
    record_inventory(inner)
    return model


def placeholder_specs(block_experts: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(local name, shape, dtype)`` of an experts module's parameters (meta or real)."""
    return [(n, tuple(p.shape), p.dtype) for n, p in block_experts.named_parameters()]


def add_placeholders(routed: RoutedExperts, specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
    for local, shape, dtype in specs:
        if "." in local:
            owner_name, _, leaf = local.rpartition(".")
            owner = routed.get_submodule(owner_name)
            if leaf in owner._parameters:
                del owner._parameters[leaf]
            elif hasattr(owner, leaf):
                delattr(owner, leaf)
            owner.register_parameter(leaf, make_placeholder(shape, dtype))
        else:
            routed.register_parameter(local, make_placeholder(shape, dtype))
