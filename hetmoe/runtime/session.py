"""HybridRuntime: the handle ``load_model`` attaches to a model as ``model.hetmoe``.

It reaches every HybridMoE of the model and the shared statistics: where the experts are, how
many bytes each side holds, the timing since the last reset, the routing statistics to save.
"""

from __future__ import annotations

import atexit
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .hybrid import HybridMoE
from .stats import RuntimeStats, Timing


@dataclass
class HybridRuntime:
    layers: dict[int, HybridMoE]
    stats: RuntimeStats
    method: str
    device: torch.device
    routing_path: Path | None = None
    load_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.routing_path is not None:
            # Write the statistics when the process ends even if nobody calls save_routing_stats;
            # a weak reference so the handle does not keep the model alive.
            ref = weakref.ref(self)
            atexit.register(lambda: (rt := ref()) is not None and rt._save_at_exit())

    @property
    def placement(self) -> dict[int, list[int]]:
        """``{layer: device expert ids}``."""
        return {layer: m.device_ids for layer, m in self.layers.items()}

    @property
    def cpu_expert_bytes(self) -> int:
        return sum(int(getattr(m.cpu, "nbytes", 0)) for m in self.layers.values())

    @property
    def device_expert_bytes(self) -> int:
        return sum(m.device_experts.nbytes for m in self.layers.values() if m.device_experts is not None)

    @property
    def timing(self) -> Timing:
        return self.stats.timing

    def reset_timing(self) -> None:
        self.stats.timing = Timing()

    def set_record_routing(self, on: bool = True) -> None:
        self.stats.record_routing = on

    def save_routing_stats(self, path: str | Path | None = None) -> Path:
        """Write the per-layer expert counts recorded so far (to ``record_routing``'s path by default)."""
        target = path or self.routing_path
        if target is None:
            raise ValueError("no path: pass one, or load the model with record_routing=PATH")
        return self.stats.save_routing(target)

    def _save_at_exit(self) -> None:
        if self.routing_path is not None and self.stats.routing:
            self.stats.save_routing(self.routing_path)

    def summary(self) -> str:
        on_device = sum(len(ids) for ids in self.placement.values())
        isa = next((getattr(m.cpu, "isa", "?") for m in self.layers.values()), "?")
        text = (
            f"{len(self.layers)} MoE layers, routed experts {self.method} in CPU memory "
            f"({_size(self.cpu_expert_bytes)}, engine {isa})"
        )
        if on_device:
            text += f", {on_device} of them also on {self.device} ({_size(self.device_expert_bytes)})"
        return text


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
