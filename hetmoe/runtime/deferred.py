"""Deferred experts: a token's lowest-scored routed experts finish while the next layer runs.

KTransformers calls this expert deferral: in decode the device waits for the CPU experts at every
MoE layer, so the CPU's share is latency the device cannot hide. Deferring the ``k`` lowest-scored
of a token's routed experts lets the layer go on as soon as the others are done; the deferred
experts keep the CPU busy while the device computes the next layer's attention and router, and
their result joins the residual stream one MoE layer later.

Here, for a HybridMoE layer ``l`` (with ``defer_experts=k``, ``0 < k < top_k``):

- each token's routed slots are ranked by routing weight; the ``k`` lowest (ties: the later slot)
  are the deferred ones, unless the expert is on the device (computed there at once: waiting for
  the device costs nothing to hide);
- the CPU engine gets two jobs: the immediate slots (awaited in layer ``l``, as without deferral)
  and the deferred slots (queued behind them, not awaited);
- the next MoE layer ``l'`` waits for that second job and adds its result to ITS MoE output.

What this approximates. In a transformers decoder layer ``h = h + attn(norm(h)); h = h + moe(norm(h))``:
the MoE output is added to the residual inside the decoder layer. Adding layer ``l``'s deferred
part ``d_l`` to layer ``l'``'s MoE output puts it back into the residual stream after layer ``l'``,
so every hidden state after ``l'`` has it (exactly once), but everything layer ``l'`` computes
(attention over ``h_l - d_l``: its query, and the key and value it writes to the KV cache for this
token, and its router and experts) and every dense layer between ``l`` and ``l'`` sees the hidden
state without ``d_l``. The last MoE layer never defers (nothing would add its part). It applies to
every forward on the hybrid path (prefill below the layerwise threshold too), so a teacher-forced
forward measures exactly what generation computes; ``defer_experts=0`` is the exact model.

Measured effect (``measure_deferral``, fp32 models, bf16 experts; ``rel`` = max |logits - exact| /
max |exact|; perplexity of the inputs' next tokens):

- tiny random Qwen3-MoE (tests/tiny_models.py: 2 MoE layers, top-2 of 8), 5 seeds of 4 x 32
  random tokens: k=1 rel 0.010 on average, 0.0155 at most; perplexity 130.656 -> 130.661.
  tests/test_deferred.py allows rel 0.05.
- the same with 4 layers and top-4: k=1 rel 0.0097 (max 0.0115), k=2 0.0119 (0.0138), k=3
  0.0170 (0.0194); perplexity 128.459 -> 128.456 / 128.460 / 128.459.
  Random weights predict nothing (perplexity ~ the 128-token vocabulary), so only ``rel`` means
  something there: deferral moves the logits by 1 to 2%, growing slowly with k.
- a trained small Qwen3-MoE (``scripts/train_default_model.py --smoke --steps 2000``: 2 MoE
  layers, top-2 of 4, hidden 64; held-out Python source, 12 x 256 tokens): k=1 perplexity
  40.88 -> 45.41 (+11%), rel 0.58 (bf16 model: the same, 40.87 -> 45.40). On 16 x 64 tokens
  40.26 -> 42.93 (+6.6%). Here the deferred expert is half of a token's routed output and the
  only layer after it (the last) never sees it: an upper end. KTransformers presents deferral as
  a speed/quality trade to check per model; so is ``defer_experts``.
- the default model (hetmoe/assets/default_model as first trained: 4 MoE layers, top-2 of 8,
  hidden 256, 500 steps, seed 0; the first 16 x 256 tokens of its heldout.txt): k=1 perplexity
  39.91 -> 40.25 (+0.8%), rel 0.20 (bf16 model: 39.94 -> 40.23). k=2 does not exist for top-2
  models (the last routed expert of a token is never deferred).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch


class _Backend(Protocol):
    def wait(self, handle: int) -> torch.Tensor: ...


@dataclass
class _Held:
    layer: int  # the layer that deferred
    backend: _Backend
    handle: int
    tokens: int
    ids: torch.Tensor  # the deferred ids [T, k] (-1 elsewhere), for the ledger


class DeferredExperts:
    """The runtime-wide state: at most one held CPU job per consuming layer, and a ledger."""

    def __init__(self, layers: list[int], k: int, top_k: int, num_experts: int) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < top_k:
            raise ValueError(
                f"defer_experts: expected an int in [0, {top_k - 1}] (fewer than top_k={top_k}), found {k!r}"
            )
        order = sorted(layers)
        self.k = k
        self.num_experts = num_experts
        self.first = order[0] if order else None
        self.next: dict[int, int] = dict(itertools.pairwise(order))  # the last layer has none
        self._held: dict[int, _Held] = {}  # by consuming layer
        # Per deferring layer, (token, expert) slots per expert: submitted deferred, and added later.
        self.deferred_counts = {layer: torch.zeros(num_experts, dtype=torch.int64) for layer in order}
        self.added_counts = {layer: torch.zeros(num_experts, dtype=torch.int64) for layer in order}
        self.discarded = 0  # held jobs dropped because their forward stopped before the next layer

    @property
    def pending(self) -> int:
        return len(self._held)

    def begin(self, layer: int) -> None:
        """Called as each MoE layer starts: the first layer starts a new forward, so anything still
        held belongs to one that stopped midway and is dropped."""
        if layer == self.first and self._held:
            for consumer in list(self._held):
                self._discard(consumer)

    def split(
        self, layer: int, ids: torch.Tensor, weights: torch.Tensor, on_device: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None:
        """``((ids, weights) now, (ids, weights) deferred)`` for the CPU engine, or None when nothing
        is deferred here. Both are the routing with the other part's slots set to id -1 (skip)."""
        if self.k == 0 or layer not in self.next or ids.numel() == 0:
            return None
        # Stable descending order: among equal weights the later slot counts as lower.
        order = torch.argsort(weights, dim=1, descending=True, stable=True)
        later = torch.zeros(ids.shape, dtype=torch.bool)
        later.scatter_(1, order[:, ids.shape[1] - self.k :], True)
        later &= ids >= 0
        later &= ~on_device[ids.clamp(min=0)]
        if not bool(later.any()):
            return None
        now_ids, later_ids = ids.masked_fill(later, -1), ids.masked_fill(~later, -1)
        now_w, later_w = weights.masked_fill(later, 0.0), weights.masked_fill(~later, 0.0)
        return (now_ids, now_w), (later_ids, later_w)

    def hold(self, layer: int, backend: _Backend, handle: int, ids: torch.Tensor) -> None:
        """Layer ``layer`` submitted its deferred slots ``ids`` as ``handle`` on ``backend``."""
        consumer = self.next[layer]
        if consumer in self._held:
            self._discard(consumer)
        self._held[consumer] = _Held(layer, backend, handle, int(ids.shape[0]), ids)
        self._tally(self.deferred_counts[layer], ids)

    def collect(self, layer: int, out: torch.Tensor) -> torch.Tensor:
        """``out`` (layer ``layer``'s MoE output ``[T, H]``) plus the deferred part held for it."""
        held = self._held.pop(layer, None)
        if held is None:
            return out
        y = held.backend.wait(held.handle)
        if held.tokens != out.shape[0]:
            raise RuntimeError(
                f"deferred experts: layer {held.layer} deferred {held.tokens} tokens, layer {layer} has "
                f"{out.shape[0]} (a forward that skips MoE layers?)"
            )
        self._tally(self.added_counts[held.layer], held.ids)
        return out + y.to(device=out.device, dtype=out.dtype)

    def _discard(self, consumer: int) -> None:
        held = self._held.pop(consumer)
        held.backend.wait(held.handle)  # the engine writes into memory the handle owns
        self.discarded += 1

    def _tally(self, counts: torch.Tensor, ids: torch.Tensor) -> None:
        flat = ids.reshape(-1)
        counts += torch.bincount(flat[flat >= 0], minlength=self.num_experts)

    def close(self) -> None:
        for consumer in list(self._held):
            self._discard(consumer)


@torch.no_grad()
def measure_deferral(
    model: Any, input_ids: torch.Tensor, ks: tuple[int, ...] = (0, 1, 2)
) -> dict[int, dict[str, float]]:
    """Deferral's effect on ``model`` (from ``load_model``) for ``input_ids [B, T]``, one teacher-forced
    forward per ``k`` in ``ks``: ``{k: {"rel": max|logits - logits_0| / max|logits_0|, "ppl": perplexity
    of input_ids[:, 1:], "nll": its mean}}``. Restores the model's setting afterwards; skips k >= top_k."""
    runtime = model.hetmoe
    before = runtime.defer_experts
    results: dict[int, dict[str, float]] = {}
    exact: torch.Tensor | None = None
    try:
        for k in sorted(set((0, *ks))):
            if k >= runtime.stats.top_k:
                continue
            runtime.set_defer_experts(k)
            logits = model(input_ids).logits.float()
            if exact is None:
                exact = logits
            nll = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1).to(logits.device)
            )
            rel = float((logits - exact).abs().max() / exact.abs().max())
            if k in ks:
                results[k] = {"rel": rel, "nll": float(nll), "ppl": math.exp(float(nll))}
    finally:
        runtime.set_defer_experts(before)
    return results
