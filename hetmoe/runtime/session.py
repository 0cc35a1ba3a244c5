"""HybridRuntime: the handle ``load_model`` attaches to a model as ``model.hetmoe``.

It reaches every HybridMoE of the model and the shared statistics: where the experts are, how
many bytes each side holds, the timing since the last reset, the routing statistics to save. It
owns the two runtime-wide modes its layers share, and can change them on a loaded model:
layerwise prefill (``set_prefill_threshold``) and deferred experts (``set_defer_experts``).
"""

from __future__ import annotations

import atexit
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .deferred import DeferredExperts
from .hybrid import HybridMoE
from .layerwise import DEFAULT_CHUNK_BYTES, LayerwisePrefill
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
    # Which path each decoder layer runs (models/paths.py, filled by load_model); summary(verbose=True)
    layer_paths: list[str] = field(default_factory=list)
    prefill_threshold: int | None = None
    prefill_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    defer_experts: int = 0
    layerwise: LayerwisePrefill | None = field(default=None, init=False)
    deferred: DeferredExperts | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        check_modes(self.prefill_threshold, self.prefill_chunk_bytes, self.defer_experts, self.stats.top_k)
        self.set_prefill_threshold(self.prefill_threshold, self.prefill_chunk_bytes)
        self.set_defer_experts(self.defer_experts)
        if self.routing_path is not None:
            # Write the statistics when the process ends even if nobody calls save_routing_stats;
            # a weak reference so the handle does not keep the model alive.
            ref = weakref.ref(self)
            atexit.register(lambda: (rt := ref()) is not None and rt._save_at_exit())

    def set_prefill_threshold(self, threshold: int | None, chunk_bytes: int | None = None) -> None:
        """Layerwise prefill for forwards of more than ``threshold`` tokens (None: off), streaming
        chunks of at most ``chunk_bytes`` dequantized bytes (see ``layerwise.py``)."""
        chunk = self.prefill_chunk_bytes if chunk_bytes is None else chunk_bytes
        check_modes(threshold, chunk, 0, self.stats.top_k)
        if self.layerwise is not None:
            self.layerwise.close()
        self.prefill_threshold, self.prefill_chunk_bytes = threshold, chunk
        self.layerwise = None if threshold is None else LayerwisePrefill(dict(self.layers), threshold, chunk)
        for m in self.layers.values():
            m.layerwise = self.layerwise

    def set_defer_experts(self, k: int) -> None:
        """Defer each token's ``k`` lowest-scored CPU experts to the next MoE layer (0: off; see ``deferred.py``)."""
        check_modes(None, self.prefill_chunk_bytes, k, self.stats.top_k)
        if self.deferred is not None:
            self.deferred.close()
        self.defer_experts = k
        self.deferred = DeferredExperts(list(self.layers), k, self.stats.top_k, self.stats.num_experts) if k else None
        for m in self.layers.values():
            m.deferred = self.deferred

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

    def summary(self, verbose: bool = False) -> str:
        """One line: the MoE layers and their experts; ``verbose`` adds a line per run of layers with
        the paths they take (attention, linears, MLP) and the lm_head's."""
        text = self._summary_line()
        if verbose and self.layer_paths:
            text += "".join(f"\n  {line}" for line in self.layer_paths)
        return text

    def _summary_line(self) -> str:
        on_device = sum(len(ids) for ids in self.placement.values())
        isa = next((getattr(m.cpu, "isa", "?") for m in self.layers.values()), "?")
        text = (
            f"{len(self.layers)} MoE layers, routed experts {self.method} in CPU memory "
            f"({_size(self.cpu_expert_bytes)}, engine {isa})"
        )
        if on_device:
            text += f", {on_device} of them also on {self.device} ({_size(self.device_expert_bytes)})"
        if self.layerwise is not None:
            text += (
                f"; layerwise prefill above {self.prefill_threshold} tokens "
                f"(streamed working set <= {_size(self.layerwise.working_set_bytes())})"
            )
        if self.deferred is not None:
            text += f"; {self.defer_experts} deferred expert(s) per token"
        return text


def check_modes(threshold: int | None, chunk_bytes: int, defer: int, top_k: int) -> None:
    """A clear error for a bad layerwise-prefill or deferral setting (before anything is loaded)."""
    if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0):
        raise ValueError(f"prefill_threshold: expected None or an int >= 0 (tokens), found {threshold!r}")
    if not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool) or chunk_bytes < 1:
        raise ValueError(f"prefill_chunk_bytes: expected an int >= 1 (bytes), found {chunk_bytes!r}")
    if not isinstance(defer, int) or isinstance(defer, bool) or not 0 <= defer < top_k:
        raise ValueError(f"defer_experts: expected an int in [0, {top_k - 1}] (below top_k={top_k}), found {defer!r}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
