"""FrozenExperts: one MoE layer's routed experts as the frozen base of fine-tuning.

The base stays in its stored (or converted) precision, as ``QuantizedTensor``s stacked ``[E, N, K]``
(gate, up ``[E, I, H]``, down ``[E, H, I]``), plus optional expert biases (gpt-oss). Two ways to
compute with it, and the autograd function (``function.py``) chooses between them:

- ``engine_pairs``: the compiled CPU engine (``CPUExperts``) gives each (token, slot) pair's
  *unweighted* expert output, by calling it with every pair as its own row and weight 1. This is
  the whole expert MLP, so it is only usable when no adapter changes gate, up or down.
- ``expert(e)``: expert ``e``'s three weights dequantized to float32 -- one expert at a time, so
  the full-precision copy never exceeds one expert (3 matrices) whatever the stored method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..formats import FormatError, QuantizedTensor, get_codec
from ..models.adapters.base import Activation, MoEAdapter
from ..runtime.cpu_experts import ENGINE_METHODS, CPUExperts
from ..runtime.torch_experts import dequantize_expert

PROJECTIONS = ("gate", "up", "down")


def dequantize_one(q: QuantizedTensor, expert: int) -> torch.Tensor:
    """Expert ``expert`` of a stacked weight in float32 (the only full-precision copy made)."""
    return dequantize_expert(q, expert, torch.float32)


def quantize_stacked(
    w: torch.Tensor | QuantizedTensor, method: str, group_size: int | None, name: str
) -> QuantizedTensor:
    """A float ``[E, N, K]`` tensor in ``method`` (one expert at a time, so the float32 detour stays
    one expert); a QuantizedTensor already in ``method`` is kept as it is."""
    if isinstance(w, QuantizedTensor):
        if w.method != method:
            raise FormatError(name, f"experts in method {method!r}", f"method {w.method!r}")
        return w
    params = {"group_size": group_size} if group_size is not None else {}
    codec = get_codec(method, **params)
    if method == "bf16":
        return codec.quantize(w.detach(), name)
    parts = [codec.quantize(w[e : e + 1].detach().float(), name) for e in range(w.shape[0])]
    tensors = {s: torch.cat([p.tensors[s] for p in parts]) for s in parts[0].tensors}
    return QuantizedTensor(parts[0].method, tuple(w.shape), tensors, parts[0].params)


@dataclass
class FrozenExperts:
    """One layer's frozen routed experts (see the module docstring)."""

    gate: QuantizedTensor
    up: QuantizedTensor
    down: QuantizedTensor
    activation: Activation
    activation_name: str = "silu"  # "silu" gets a closed-form derivative; anything else uses autograd
    biases: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 gate/up [E, I], down [E, H]
    engine: Any = None  # CPUExperts, or None where the engine cannot run these experts

    def __post_init__(self) -> None:
        e, i, h = self.gate.shape
        if tuple(self.up.shape) != (e, i, h) or tuple(self.down.shape) != (e, h, i):
            raise FormatError(
                "experts",
                f"gate/up [E, I, H] and down [E, H, I] with E={e}, I={i}, H={h}",
                f"up {list(self.up.shape)}, down {list(self.down.shape)}",
            )
        self.biases = {k: v.detach().float() for k, v in self.biases.items()}

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    @property
    def intermediate(self) -> int:
        return self.gate.shape[1]

    @property
    def hidden(self) -> int:
        return self.gate.shape[2]

    @property
    def method(self) -> str:
        methods = {q.method for q in (self.gate, self.up, self.down)}
        return methods.pop() if len(methods) == 1 else "mixed"

    @property
    def nbytes(self) -> int:
        """Bytes held for the base: stored codes and scales, and biases."""
        return sum(q.nbytes for q in (self.gate, self.up, self.down)) + sum(
            b.numel() * b.element_size() for b in self.biases.values()
        )

    @property
    def logical_params(self) -> int:
        e, i, h = self.gate.shape
        return 3 * e * i * h + sum(b.numel() for b in self.biases.values())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the base holds (for memory accounting), the engine's repacked copies included."""
        out = [t for q in (self.gate, self.up, self.down) for t in q.tensors.values()]
        out += list(self.biases.values())
        out += list(getattr(self.engine, "_keep", []))
        return out

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert ``e``'s gate ``[I, H]``, up ``[I, H]``, down ``[H, I]`` in float32."""
        return dequantize_one(self.gate, e), dequantize_one(self.up, e), dequantize_one(self.down, e)

    def bias(self, name: str, e: int) -> torch.Tensor | None:
        b = self.biases.get(name)
        return None if b is None else b[e]

    def engine_pairs(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Unweighted expert outputs ``[T, k, H]`` (fp32) of every (token, slot) pair, by the engine.

        Each pair is one row of the engine's input with weight 1, so the engine's weighted sum is
        the pair's own expert output; slots with id -1 give zeros. Same work as one layer forward.
        """
        if self.engine is None:
            raise RuntimeError("engine_pairs: these experts have no CPU engine")
        t, k = ids.shape
        rows = x.float().unsqueeze(1).expand(t, k, x.shape[1]).reshape(t * k, x.shape[1]).contiguous()
        flat = ids.reshape(t * k, 1).to(torch.int64).contiguous()
        ones = torch.ones(t * k, 1, dtype=torch.float32)
        return self.engine.forward(rows, flat, ones).view(t, k, x.shape[1])


def engine_for(
    gate: QuantizedTensor,
    up: QuantizedTensor,
    down: QuantizedTensor,
    adapter: MoEAdapter,
    biases: dict[str, torch.Tensor],
) -> CPUExperts | None:
    """A CPUExperts over the same stored tensors (no copy for bf16/int8/int4/fp8), or None when the
    engine cannot run these experts: activation it lacks, method it lacks, or K not a multiple of 32."""
    act = adapter.engine_activation()
    if act is None or gate.method not in ENGINE_METHODS or len({gate.method, up.method, down.method}) != 1:
        return None
    if biases and not act:
        return None
    kwargs: dict[str, Any] = dict(act)
    for name, b in biases.items():
        kwargs[f"{name}_bias"] = b
    try:
        return CPUExperts(gate, up, down, verbose=False, **kwargs)
    except FormatError:
        return None  # e.g. K % 32 != 0: the torch path computes these experts


def activation_name(adapter: MoEAdapter) -> str:
    act = adapter.engine_activation()
    if act is None:
        return str(getattr(adapter.config, "hidden_act", "custom"))
    return str(act.get("activation", "silu"))
