"""Experts computed with torch operations: the device's share of a layer, and a CPU fallback.

``run_experts`` mirrors transformers' eager expert loop operation for operation (experts in
ascending id order, gate and up projections, activation, down projection, times the routing weight
in the router's dtype, ``index_add_`` in the activations' dtype), so a bf16 model gives what
transformers' eager experts give, up to the matrix-multiply blocking of the BLAS.

``TorchCPUExperts`` is a FALLBACK for architectures whose experts the compiled engine does not run
yet: today only gpt-oss (expert biases and a clamped SwiGLU). It has CPUExperts' submit/wait
interface but computes synchronously in ``submit``, one routed expert at a time, dequantizing that
expert from its stored (possibly quantized) form on each use, so nothing beyond the stored bytes is
held. Exact, not fast.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..formats import QuantizedTensor, get_codec

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ExpertWeights:
    """One expert: gate, up ``[I, H]``, down ``[H, I]`` and optional biases, ready for ``F.linear``."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        ts = (self.gate, self.up, self.down, self.gate_bias, self.up_bias, self.down_bias)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def dequantize_expert(q: QuantizedTensor, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``expert`` of a stacked ``[E, N, K]`` weight, in ``dtype`` (a view-cast for bf16)."""
    if q.method == "bf16":
        return q.tensors[".weight"][expert].to(dtype)
    one = QuantizedTensor(q.method, tuple(q.shape[1:]), {s: t[expert] for s, t in q.tensors.items()}, q.params)
    return get_codec(q.method, **q.params).dequantize(one, dtype)


def expert_weights(
    gate: QuantizedTensor,
    up: QuantizedTensor,
    down: QuantizedTensor,
    biases: dict[str, torch.Tensor],
    expert: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> ExpertWeights:
    """One expert of a layer's stored projections (and biases), dequantized to ``dtype`` on ``device``."""

    def bias(name: str) -> torch.Tensor | None:
        b = biases.get(name)
        return None if b is None else b[expert].to(device=device, dtype=dtype)

    return ExpertWeights(
        dequantize_expert(gate, expert, dtype).to(device),
        dequantize_expert(up, expert, dtype).to(device),
        dequantize_expert(down, expert, dtype).to(device),
        bias("gate"),
        bias("up"),
        bias("down"),
    )


def run_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    fetch: Callable[[int], ExpertWeights | None],
    act: Activation,
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` over the experts ``fetch`` returns (None: skip).

    ``counts [E]`` (optional) gets the number of tokens each computed expert processed.
    """
    y = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():  # ascending, as transformers iterates
        if e < 0:
            continue
        w = fetch(e)
        if w is None:
            continue
        # Slot-major order of (slot, token) pairs, like transformers' where() over [k, T].
        pos, tok = torch.where(ids.T.eq(e))
        cur = x[tok]
        g = F.linear(cur, w.gate)
        u = F.linear(cur, w.up)
        if w.gate_bias is not None:
            g = g + w.gate_bias
        if w.up_bias is not None:
            u = u + w.up_bias
        out = F.linear(act(g, u), w.down)
        if w.down_bias is not None:
            out = out + w.down_bias
        out = out * weights[tok, pos, None]
        y.index_add_(0, tok, out.to(y.dtype))
        if counts is not None:
            counts[e] += tok.numel()
    return y


class TorchCPUExperts:
    """FALLBACK for gpt-oss (see the module docstring): CPUExperts' interface, computed by torch."""

    def __init__(
        self,
        gate: QuantizedTensor,
        up: QuantizedTensor,
        down: QuantizedTensor,
        biases: dict[str, torch.Tensor] | None,
        act: Activation,
    ) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.biases = dict(biases or {})
        self.act = act
        self.experts, self.intermediate, self.hidden = gate.shape
        self.method = gate.method
        self._mask = torch.zeros(self.experts, dtype=torch.bool)
        self._results: dict[int, torch.Tensor] = {}
        self._handles = itertools.count(1)
        self.isa = "torch (fallback)"

    @property
    def nbytes(self) -> int:
        weights = sum(q.nbytes for q in (self.gate, self.up, self.down))
        return weights + sum(b.numel() * b.element_size() for b in self.biases.values())

    @property
    def mask(self) -> torch.Tensor:
        return self._mask.clone()

    def set_mask(self, mask: torch.Tensor) -> None:
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (self.experts,):
            raise ValueError(f"mask: expected a bool tensor [{self.experts}]")
        self._mask.copy_(mask.bool().cpu())

    def _fetch(self, dtype: torch.dtype) -> Callable[[int], ExpertWeights | None]:
        def fetch(e: int) -> ExpertWeights | None:
            if bool(self._mask[e]):
                return None
            return expert_weights(self.gate, self.up, self.down, self.biases, e, dtype)

        return fetch

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int:
        """Computes at once (no overlap: this is the fallback) and returns a handle for ``wait``."""
        handle = next(self._handles)
        self._results[handle] = run_experts(x, topk_ids, topk_weights, self._fetch(x.dtype), self.act)
        return handle

    def wait(self, handle: int) -> torch.Tensor:
        if handle not in self._results:
            raise ValueError(f"handle {handle!r} is not pending on this TorchCPUExperts")
        return self._results.pop(handle)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.wait(self.submit(x, topk_ids, topk_weights))

    __call__ = forward
