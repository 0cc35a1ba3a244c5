"""Dense layers in the CPU engine: ``load_model(dense_method=...)``.

Every ``nn.Linear`` of the model outside the routed experts (attention projections, dense MLP
layers, shared experts, the lm_head) becomes a ``CPULinear`` holding its weight in an engine method
(int8, int4 g32, bf16, a GGUF block type ...). Not converted: the routers (and Qwen's shared-expert
gate), which are the Linear children of a MoE block and whose scores choose the experts; norms and
embeddings, which are not Linear; and a layer the engine cannot run in that method (e.g. an input
width that is not a multiple of 32), which stays a torch Linear and is named in the load notes.

Conversion happens while the non-expert weights are read: each weight is quantized as soon as it
is read and its full-precision value dropped, so only one layer's weight ever exists in full
precision (a tied lm_head is quantized from the embedding once loading is done).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ..formats import QuantizedTensor
from ..runtime.cpu_linear import CPULinear, check_method, quantize_weight, unsupported_reason
from ..runtime.fused_linears import fuse_siblings


class DenseConverter:
    """Chooses the model's dense Linears, quantizes their weights as they are read, swaps them in."""

    def __init__(
        self,
        model: nn.Module,
        method: str,
        group_size: int | None,
        moe_blocks: list[nn.Module],
        keep_fp32: list[re.Pattern[str]],
        gemv_max_tokens: int | None = None,
        fuse: bool = True,
    ) -> None:
        check_method(method, "dense_method")
        self.method, self.group_size, self.gemv_max_tokens = method, group_size, gemv_max_tokens
        self.fuse = fuse  # sibling projections (q/k/v, gate/up) as one engine call: fused_linears.py
        routers = {id(child) for block in moe_blocks for child in block.children() if isinstance(child, nn.Linear)}
        self.targets: dict[str, nn.Linear] = {}
        self.skipped: dict[str, str] = {}
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear) or id(mod) in routers or any(p.search(name) for p in keep_fp32):
                continue
            reason = unsupported_reason(method, mod.in_features, group_size)
            if reason is None:
                self.targets[name] = mod
            else:
                self.skipped[name] = reason
        self._by_owner = {id(mod): name for name, mod in self.targets.items()}
        self._quantized: dict[str, QuantizedTensor] = {}

    def take(self, owner: nn.Module, local: str, value: torch.Tensor) -> bool:
        """Called for each tensor read: a target's weight is quantized and kept here (True), so it
        is never placed in the model in full precision; anything else is left to the caller (False)."""
        name = self._by_owner.get(id(owner))
        if name is None or local != "weight":
            return False
        self._quantized[name] = quantize_weight(value, self.method, self.group_size, f"{name}.weight")
        return True

    def finish(self, model: nn.Module) -> list[str]:
        """Swap every target for its CPULinear; returns notes for the load summary."""
        for name, mod in self.targets.items():
            q = self._quantized.pop(name, None)
            if q is None:  # a tied weight (lm_head = embeddings): loaded by tie_weights, quantized now
                if mod.weight.is_meta:
                    raise ValueError(f"{name}.weight: neither read from the checkpoint nor tied to a loaded tensor")
                q = quantize_weight(mod.weight, self.method, self.group_size, f"{name}.weight")
            linear = CPULinear(q, mod.bias, gemv_max_tokens=self.gemv_max_tokens)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, linear)
        notes = []
        if self.fuse:
            fused = fuse_siblings(model)
            if fused:
                notes.append(f"dense layers: {fused} sets of sibling projections (q/k/v, gate/up) run as one call each")
        if self.skipped:
            first = next(iter(self.skipped.items()))
            notes.append(
                f"dense layers: {len(self.skipped)} Linear layers stay in torch ({self.method} cannot run them), "
                f"e.g. {first[0]}: {first[1]}"
            )
        transcoded = {m.note for m in model.modules() if isinstance(m, CPULinear) and m.note}
        notes += [f"dense layers: {note}" for note in sorted(transcoded)]
        return notes


def dense_linears(model: nn.Module) -> list[CPULinear]:
    return [m for m in model.modules() if isinstance(m, CPULinear)]
