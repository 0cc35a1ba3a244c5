"""Per-expert LoRA hosts: where PEFT puts the routed experts' adapters on a hetmoe model.

``RoutedExperts`` stands where the block's ``experts`` was. It is a list of experts, each with its
gate, up and down projection as a Linear module named the way the architecture's per-expert
checkpoints name them (``gate_proj/up_proj/down_proj``; Mixtral-style ``w1/w3/w2``), so a PEFT
``LoraConfig(target_modules=["gate_proj", "up_proj", "down_proj"])`` wraps them with ordinary
``lora.Linear`` layers and the adapter saves with PEFT's per-expert key names
(``...mlp.experts.3.gate_proj.lora_A.weight``). The hosts hold no weight: for a fused source the
placeholders keep the original names (``experts.gate_up_proj``) on RoutedExperts itself and the
host Linear modules carry an empty, unregistered ``weight``; for a per-expert source the hosts
are the model's own Linear modules (PEFT-wrapped or not) with their weights turned placeholders.

``collect_lora`` reads the active adapter of every host and stacks it into the ``[E, r, in]`` /
``[E, out, r]`` factors the autograd function takes (experts without an adapter get zeros).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .frozen import PROJECTIONS
from .function import ExpertLoRA, LoRAFactors

MIXTRAL_STYLE = ("mixtral", "minimax_m2")


def host_names(model_type: str) -> tuple[str, str, str]:
    return ("w1", "w3", "w2") if model_type in MIXTRAL_STYLE else ("gate_proj", "up_proj", "down_proj")


class ExpertLoRAHost(nn.Linear):
    """A weightless Linear that only hosts PEFT's LoRA for one projection of one routed expert."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, where: str) -> None:
        super().__init__(in_features, out_features, bias=False, device="meta")
        del self.weight
        self.weight = torch.empty(0, dtype=dtype)  # unregistered: the model holds no expert weight
        self.where = where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(
            f"{self.where}: this module only hosts the LoRA of a routed expert; the enclosing SFTMoE computes the "
            "experts from the CPU engine's weights"
        )


class RoutedExperts(nn.ModuleList):
    """The routed experts' LoRA hosts (one child per expert) and the placeholders of the original names."""

    def __init__(self, experts: list[nn.Module], names: tuple[str, str, str]) -> None:
        super().__init__(experts)
        self.proj_names = names

    @classmethod
    def weightless(
        cls,
        num_experts: int,
        hidden: int,
        intermediate: int,
        names: tuple[str, str, str],
        dtype: torch.dtype,
        where: str,
    ) -> RoutedExperts:
        dims = {names[0]: (hidden, intermediate), names[1]: (hidden, intermediate), names[2]: (intermediate, hidden)}
        experts = []
        for e in range(num_experts):
            m = nn.Module()
            for n, (i, o) in dims.items():
                setattr(m, n, ExpertLoRAHost(i, o, dtype, f"{where}.{e}.{n}"))
            experts.append(m)
        return cls(experts, names)

    def extra_repr(self) -> str:
        return f"hosts={self.proj_names}"


def _lora_layer(m: nn.Module) -> bool:
    return all(hasattr(m, a) for a in ("lora_A", "lora_B", "scaling", "active_adapters"))


def _factors(mods: list[nn.Module], where: str) -> LoRAFactors | None:
    """Stacked factors of one projection across experts, or None when no expert has an active adapter."""
    found: list[tuple[torch.Tensor, torch.Tensor, float, float] | None] = []
    for e, m in enumerate(mods):
        if not _lora_layer(m) or getattr(m, "disable_adapters", False):
            found.append(None)
            continue
        if getattr(m, "merged", False):
            raise ValueError(
                f"{where}.{e}: a merged LoRA cannot live on a routed expert (its weights are in the engine)"
            )
        active = [a for a in m.active_adapters if a in m.lora_A]
        if len(active) > 1:
            raise ValueError(f"{where}.{e}: {len(active)} active adapters {active}; hetmoe trains one at a time")
        if not active:
            found.append(None)
            continue
        a = active[0]
        if m.use_dora.get(a, False) or m.lora_bias.get(a, False):
            raise ValueError(f"{where}.{e}: DoRA and lora_bias are not supported on routed experts")
        drop = m.lora_dropout[a]
        p = float(drop.p) if isinstance(drop, nn.Dropout) and drop.training else 0.0
        found.append((m.lora_A[a].weight, m.lora_B[a].weight, float(m.scaling[a]), p))
    present = [f for f in found if f is not None]
    if not present:
        return None
    a0, b0, s0, p0 = present[0]
    for e, f in enumerate(found):
        if f is not None and (f[0].shape != a0.shape or f[1].shape != b0.shape or f[2] != s0 or f[3] != p0):
            raise ValueError(
                f"{where}.{e}: LoRA rank/scaling/dropout {list(f[0].shape)}, {f[2]}, {f[3]} differ from another "
                f"expert's {list(a0.shape)}, {s0}, {p0}; one layer's experts must share them"
            )
    a = torch.stack([f[0] if f is not None else a0.new_zeros(a0.shape) for f in found])
    b = torch.stack([f[1] if f is not None else b0.new_zeros(b0.shape) for f in found])
    return LoRAFactors(a, b, s0, p0)


def collect_lora(experts: RoutedExperts, where: str = "experts") -> ExpertLoRA | None:
    out: dict[str, Any] = {}
    for role, name in zip(PROJECTIONS, experts.proj_names, strict=True):
        out[role] = _factors([getattr(ex, name) for ex in experts], f"{where}.*.{name}")
    lora = ExpertLoRA(**out)
    return lora if lora else None
