"""load_for_training: a model to fine-tune, its routed experts read straight from checkpoint files.

``hetmoe.load_model`` builds the model on the meta device, loads the non-expert weights, and reads
each layer's experts with ``checkpoint.experts.read_layer_experts`` in their stored precision
(bf16, fp8 block, compressed-tensors int4, an expert store's int8/int4, gptq, ...) -- or converts
them one layer at a time when ``method`` is given -- into the CPU engine, never materialising
the frozen base in full precision. Here each inference HybridMoE is swapped for an ``SFTMoE`` over
the same stored tensors and engine; the expert parameter names the architecture would have are
recorded as zero-storage placeholders (from a meta-device instance of the block's experts).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..models.loader import load_model
from ..runtime.cpu_experts import CPUExperts
from .block import SFTMoE
from .frozen import FrozenExperts, activation_name
from .hosts import RoutedExperts, host_names
from .placeholders import record_inventory
from .prepare import add_placeholders, placeholder_specs


def _meta_experts(model: nn.Module, block_class: str, config: Any) -> nn.Module | None:
    """The architecture's own experts module on the meta device (for the placeholder names)."""
    module = sys.modules.get(type(model).__module__)
    cls = getattr(module, block_class, None)
    if cls is None:
        return None
    with torch.device("meta"):
        return cls(config).experts


def load_for_training(
    path: str | Path,
    method: str | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    group_size: int | None = None,
    recompute: bool = False,
    use_engine: bool = True,
) -> Any:
    """A transformers causal LM from ``path`` with SFTMoE blocks (arguments as ``load_model``'s).

    All parameters come back frozen (``requires_grad=False``): PEFT (``hetmoe.sft.get_peft_model``)
    or the caller decides what trains.
    """
    model = load_model(path, method=method, device=device, dtype=dtype, group_size=group_size)
    runtime = model.hetmoe
    for layer, hybrid in runtime.layers.items():
        adapter = hybrid.adapter
        cpu = hybrid.cpu
        engine = cpu if (use_engine and isinstance(cpu, CPUExperts)) else None
        biases = {k: v for k, v in hybrid.biases.items()}
        base = FrozenExperts(cpu.gate, cpu.up, cpu.down, adapter.activation, activation_name(adapter), biases, engine)
        e, i, h = cpu.gate.shape
        where = f"layer {layer} experts"
        routed = RoutedExperts.weightless(e, h, i, host_names(adapter.name), hybrid.compute_dtype, where)
        meta = _meta_experts(model, hybrid.block_class, model.config)
        if meta is not None:
            add_placeholders(routed, [(n, s, hybrid.compute_dtype) for n, s, _ in placeholder_specs(meta)])
        sft = SFTMoE(hybrid, adapter, layer, base, routed, recompute=recompute, use_engine=use_engine)
        parent, attr = _find_parent(model, hybrid)
        setattr(parent, attr, sft)
    del model.hetmoe  # the inference runtime's handle; SFTMoE now owns the experts
    model.requires_grad_(False)
    record_inventory(model)
    return model


def _find_parent(model: nn.Module, child: nn.Module) -> tuple[nn.Module, str]:
    for name, m in model.named_modules():
        if m is child:
            parent, _, attr = name.rpartition(".")
            return model.get_submodule(parent), attr
    raise ValueError("internal: a HybridMoE that is not in its model")
