"""What the hybrid runtime measures while it runs: where time went, and which experts were used.

``RuntimeStats`` is shared by every HybridMoE of a model. Timing: ``cpu_s`` sums, per MoE layer
call, the span from submitting the CPU experts to having their result (what the CPU engine cost
the layer, overlapped with the device's work); ``wait_s`` the part of it the caller spent blocked
in ``wait`` (the CPU time the device could not hide); ``moe_s`` the whole MoE block. Routing:
per layer, how many tokens each expert received, written as JSON by ``save_routing`` and read
back by the ``frequency`` placement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROUTING_FORMAT = "hetmoe-routing-stats"
ROUTING_VERSION = 1


@dataclass
class Timing:
    calls: int = 0
    tokens: int = 0
    cpu_s: float = 0.0
    wait_s: float = 0.0
    moe_s: float = 0.0

    def snapshot(self) -> Timing:
        return Timing(self.calls, self.tokens, self.cpu_s, self.wait_s, self.moe_s)

    def __sub__(self, other: Timing) -> Timing:
        return Timing(
            self.calls - other.calls,
            self.tokens - other.tokens,
            self.cpu_s - other.cpu_s,
            self.wait_s - other.wait_s,
            self.moe_s - other.moe_s,
        )


@dataclass
class RuntimeStats:
    num_experts: int
    top_k: int
    model_type: str = ""
    timing: Timing = field(default_factory=Timing)
    record_routing: bool = False
    # layer -> int64 [E] tokens routed to each expert (only while record_routing)
    routing: dict[int, torch.Tensor] = field(default_factory=dict)
    routed_tokens: dict[int, int] = field(default_factory=dict)

    def record(self, layer: int, ids: torch.Tensor) -> None:
        flat = ids.reshape(-1)
        counts = torch.bincount(flat[flat >= 0].cpu(), minlength=self.num_experts)
        if layer in self.routing:
            self.routing[layer] += counts
        else:
            self.routing[layer] = counts
        self.routed_tokens[layer] = self.routed_tokens.get(layer, 0) + int(ids.shape[0])

    def routing_json(self) -> dict[str, Any]:
        return {
            "format": ROUTING_FORMAT,
            "version": ROUTING_VERSION,
            "model_type": self.model_type,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "layers": {
                str(layer): {"tokens": self.routed_tokens.get(layer, 0), "counts": counts.tolist()}
                for layer, counts in sorted(self.routing.items())
            },
        }

    def save_routing(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.routing_json(), indent=1))
        tmp.replace(p)
        return p


def load_routing(path: str | Path, num_experts: int | None = None) -> dict[int, torch.Tensor]:
    """Per-layer expert counts from a routing-statistics file; a clear error for anything else."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{p}: cannot read routing statistics: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != ROUTING_FORMAT or not isinstance(data.get("layers"), dict):
        raise ValueError(f"{p}: not a hetmoe routing-statistics file (expected format {ROUTING_FORMAT!r})")
    if num_experts is not None and data.get("num_experts") != num_experts:
        raise ValueError(f"{p}: recorded for {data.get('num_experts')} experts, this model has {num_experts}")
    out: dict[int, torch.Tensor] = {}
    for layer, entry in data["layers"].items():
        counts = entry.get("counts") if isinstance(entry, dict) else None
        if not isinstance(counts, list) or (num_experts is not None and len(counts) != num_experts):
            raise ValueError(f"{p}: layer {layer}: expected {num_experts} expert counts, found {counts!r:.80}")
        out[int(layer)] = torch.tensor(counts, dtype=torch.float64)
    return out
