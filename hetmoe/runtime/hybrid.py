"""HybridMoE: one sparse MoE block, its routed experts split between the device and the CPU engine.

It stands in for the architecture's own MoE block and adopts every part of that block except the
routed experts (router, shared experts, correction-bias buffers) under the same names, so the
model's state-dict keys stay the checkpoint's. A forward:

1. routes on the device with the adapter's routing function (the architecture's exact math on
   the block's own router parameters);
2. submits the token batch to the CPU engine, which skips the experts in the device mask;
3. meanwhile computes the device experts (DeviceExperts) and the shared experts on the device;
4. waits for the CPU result and sums everything in the model's dtype.

Every (token, expert) pair is computed exactly once: on the device when the expert is in the
mask, else on the CPU. Optional: routing statistics per expert (for the ``frequency`` placement)
and dynamic re-placement every ``replace_every`` calls (``placement.choose_swaps``).

Two runtime-wide modes change step 2 (set through ``HybridRuntime``, shared by all layers):

- layerwise prefill (``layerwise.py``): a forward of more than ``prefill_threshold`` tokens
  computes every routed expert on the device, the CPU experts streamed over in chunks;
- deferred experts (``deferred.py``): each token's lowest-scored ``defer_experts`` CPU experts are
  submitted as a second job whose result the next MoE layer adds to its output.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..formats import QuantizedTensor
from ..models.adapters.base import MoEAdapter
from .cpu_experts import CPUExperts
from .device_experts import DeviceExperts
from .layerwise import compute_layer
from .placement import choose_swaps
from .stats import RuntimeStats
from .torch_experts import ExpertWeights, expert_weights

if TYPE_CHECKING:
    from .deferred import DeferredExperts
    from .layerwise import LayerwisePrefill

_ENGINE_X_DTYPES = (torch.bfloat16, torch.float32)


def _on_cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor of ``dtype``, detached; itself where it is one already (a
    decode step makes these checks in every layer, and each no-op torch call costs a microsecond)."""
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu" or t.dtype != dtype:
        t = t.to(device="cpu", dtype=dtype)
    return t if t.is_contiguous() else t.contiguous()


class ExpertBackend(Protocol):
    """What HybridMoE needs from the CPU side: CPUExperts, or the torch fallback."""

    gate: QuantizedTensor
    up: QuantizedTensor
    down: QuantizedTensor
    experts: int

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> int: ...

    def wait(self, handle: int) -> torch.Tensor: ...

    def set_mask(self, mask: torch.Tensor) -> None: ...


def adopt_block_members(module: nn.Module, block: nn.Module) -> None:
    """Give ``module`` the sparse block's router, shared experts, parameters and buffers under their own
    names (everything but its routed ``experts``), so state-dict keys and the adapters' routing see them."""
    for name, child in block.named_children():
        if name != "experts":
            module.add_module(name, child)
    for name, param in block.named_parameters(recurse=False):
        module.register_parameter(name, param)
    for name, buf in block.named_buffers(recurse=False):
        module.register_buffer(name, buf, persistent=name not in block._non_persistent_buffers_set)


class HybridMoE(nn.Module):
    def __init__(
        self,
        block: nn.Module,
        adapter: MoEAdapter,
        layer: int,
        stats: RuntimeStats,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        adopt_block_members(self, block)
        self.adapter = adapter
        self.layer = layer
        self.stats = stats
        self.compute_dtype = dtype
        self.device = torch.device(device)
        self.block_class = type(block).__name__
        self.cpu: ExpertBackend | None = None
        self.biases: dict[str, torch.Tensor] = {}
        self.device_experts: DeviceExperts | None = None
        self._device_mask = torch.zeros(0, dtype=torch.bool)
        # Tokens each expert processed on the CPU side (the device side counts in DeviceExperts),
        # and, in layerwise prefill, on the device from streamed weights.
        self._cpu_counts = torch.zeros(0, dtype=torch.int64)
        self._uncounted: list[torch.Tensor] = []  # routed ids not yet added to _cpu_counts
        self.streamed_counts = torch.zeros(0, dtype=torch.int64)
        # Runtime-wide modes, set by HybridRuntime (None: off).
        self.layerwise: LayerwisePrefill | None = None
        self.deferred: DeferredExperts | None = None
        self.replace_every = 0
        self.replace_margin = 0.25
        self.replacements = 0  # experts swapped in by dynamic re-placement so far
        self._live = torch.zeros(0, dtype=torch.float64)
        self._calls = 0

    def attach(
        self,
        cpu: ExpertBackend,
        device_ids: list[int] | tuple[int, ...] = (),
        biases: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Give the block its experts: all on ``cpu``, the ``device_ids`` copied to the device.

        ``biases`` (gpt-oss: ``gate``/``up`` ``[E, I]``, ``down`` ``[E, H]``) are the stored expert
        biases, from which device copies are made (CPUExperts keeps its own fp32 copy).
        """
        self.cpu = cpu
        self.biases = dict(biases or {})
        n = cpu.experts
        self.device_experts = DeviceExperts(n, self.adapter.activation, self.device)
        self._cpu_counts = torch.zeros(n, dtype=torch.int64)
        self._uncounted = []
        self.streamed_counts = torch.zeros(n, dtype=torch.int64)
        self._live = torch.zeros(n, dtype=torch.float64)
        for e in device_ids:
            self.device_experts.add(e, self._expert_weights(e))
        self._sync_mask()

    def enable_replacement(self, every: int, margin: float = 0.25) -> None:
        """Re-place every ``every`` calls from live routing counts (0 turns it off)."""
        if every < 0 or margin < 0:
            raise ValueError(f"replace_every and the margin must be >= 0, got {every} and {margin}")
        self.replace_every, self.replace_margin = int(every), float(margin)

    @property
    def device_ids(self) -> list[int]:
        return self.device_experts.ids if self.device_experts is not None else []

    def _expert_weights(self, e: int) -> ExpertWeights:
        assert self.cpu is not None
        return expert_weights(
            self.cpu.gate, self.cpu.up, self.cpu.down, self.biases, e, self.compute_dtype, self.device
        )

    def _sync_mask(self) -> None:
        assert self.cpu is not None and self.device_experts is not None
        self._device_mask = self.device_experts.mask()
        self.cpu.set_mask(self._device_mask)

    def one_token_in_engine(self) -> bool:
        """A one-token forward would run every routed expert in the CPU engine (CPUExperts), with
        nothing for forward_routed to do in Python around it: no expert on the device, none deferred,
        no layerwise prefill, no routing recorded. Then a one-call decode layer may run this block
        inside its engine call (models/fast_decode.py, models/mla_decode.py)."""
        return (
            isinstance(self.cpu, CPUExperts)
            and not len(self.device_experts or ())
            and self.deferred is None
            and (self.layerwise is None or not self.layerwise.applies(1))
            and not self.stats.record_routing
        )

    def count_block_step(self, seconds: float) -> None:
        """Count a one-token forward of this block that a one-call decode block ran inside its engine
        call (``seconds`` long), as forward_routed counts its own; the caller waited for all of it."""
        t = self.stats.timing
        t.calls += 1
        t.tokens += 1
        t.moe_s += seconds
        t.cpu_s += seconds
        t.wait_s += seconds

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, ids = self.adapter.route(self, x)
        out = self.forward_routed(x, weights, ids, start).reshape(hidden_states.shape)
        return (out, weights) if self.adapter.returns_router_scores else out

    def forward_routed(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, start: float | None = None
    ) -> torch.Tensor:
        """The block's output ``[T, H]`` for ``x [T, H]`` routed to ``ids`` with ``weights`` (the
        adapter's routing; models/fast_decode.py routes from logits the engine computed)."""
        if self.cpu is None or self.device_experts is None:
            raise RuntimeError(f"HybridMoE of layer {self.layer} has no experts attached")
        if torch.is_grad_enabled() and x.requires_grad:
            # The engine has no backward: gradients would silently skip the routed experts.
            raise RuntimeError("HybridMoE is inference-only: run under torch.no_grad() (fine-tuning is hetmoe sft)")
        if start is None:
            start = time.perf_counter()
        if self.deferred is not None:
            self.deferred.begin(self.layer)
        with torch.no_grad():
            ids_cpu = _on_cpu(ids, torch.int64)
            if self.layerwise is not None and self.layerwise.applies(x.shape[0]):
                out = self._forward_layerwise(x, ids, weights)
            else:
                out = self._forward_hybrid(x, ids, weights, ids_cpu)
            if self.deferred is not None:
                waiting = time.perf_counter()
                out = self.deferred.collect(self.layer, out)  # the previous MoE layer's deferred experts
                blocked = time.perf_counter() - waiting
                self.stats.timing.wait_s += blocked
                self.stats.timing.cpu_s += blocked
        t = self.stats.timing
        t.calls += 1
        t.tokens += x.shape[0]
        t.moe_s += time.perf_counter() - start
        if self.stats.record_routing:
            self.stats.record(self.layer, ids_cpu)
        self._maybe_replace(ids_cpu)
        return out

    def _forward_hybrid(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, ids_cpu: torch.Tensor
    ) -> torch.Tensor:
        """Device experts on the device, the rest on the CPU engine (some of them deferred)."""
        assert self.cpu is not None and self.device_experts is not None
        # The engine's contract: CPU, contiguous, x in bf16/fp32, int64 ids, fp32 weights.
        x_cpu = _on_cpu(x, x.dtype if x.dtype in _ENGINE_X_DTYPES else torch.float32)
        w_cpu = _on_cpu(weights, torch.float32)
        self._count(ids_cpu)
        split = None
        if self.deferred is not None:
            split = self.deferred.split(self.layer, ids_cpu, w_cpu, self._device_mask)
        submitted = time.perf_counter()
        if split is None:
            handle = self.cpu.submit(x_cpu, ids_cpu, w_cpu)
        else:
            (now_ids, now_w), (later_ids, later_w) = split
            handle = self.cpu.submit(x_cpu, now_ids, now_w)
            try:
                later = self.cpu.submit(x_cpu, later_ids, later_w)  # queued behind the immediate job
            except BaseException:
                self.cpu.wait(handle)
                raise
            assert self.deferred is not None
            self.deferred.hold(self.layer, self.cpu, later, later_ids)
        try:
            routed = self.device_experts.forward(x, ids, weights) if len(self.device_experts) else None
            shared = self.adapter.shared(self, x)
        finally:
            # Always collect the job: the engine writes into memory owned by the pending handle.
            waiting = time.perf_counter()
            y_cpu = self.cpu.wait(handle)
            done = time.perf_counter()
        out = y_cpu if y_cpu.device == x.device and y_cpu.dtype == x.dtype else y_cpu.to(device=x.device, dtype=x.dtype)
        if routed is not None:
            out = out + routed
        if shared is not None:
            out = out + shared
        t = self.stats.timing
        t.cpu_s += done - submitted
        t.wait_s += done - waiting
        return out

    def _forward_layerwise(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every routed expert on the device: resident ones as they are, the rest streamed over."""
        assert self.layerwise is not None and self.device_experts is not None
        routed = compute_layer(
            self.layerwise, self.layer, x, ids, weights, self.device_experts, self._expert_weights, self.streamed_counts
        )
        shared = self.adapter.shared(self, x)
        return routed if shared is None else routed + shared

    @property
    def cpu_counts(self) -> torch.Tensor:
        """Tokens each expert processed on the CPU side, per expert ``[E]``."""
        self._flush_counts()
        return self._cpu_counts

    def _flush_counts(self) -> None:
        if self._uncounted:
            flat = torch.cat(self._uncounted)
            self._uncounted = []
            self._cpu_counts += torch.bincount(flat, minlength=self._cpu_counts.numel())

    def _count(self, ids: torch.Tensor) -> None:
        # ids come from the router's top-k: every one is an expert index (no -1 here). Counted in
        # batches: a bincount per decode step cost ~50 us a layer, more than the routing it counts.
        flat = ids.reshape(-1)
        if len(self.device_experts or ()):
            flat = flat[~self._device_mask[flat]]
        self._uncounted.append(flat.clone())  # a copy: the caller may reuse the ids tensor
        if len(self._uncounted) >= 256:
            self._flush_counts()

    def _maybe_replace(self, ids: torch.Tensor) -> None:
        if not self.replace_every or not len(self.device_experts or ()):
            return
        flat = ids.reshape(-1)
        self._live += torch.bincount(flat[flat >= 0], minlength=self._live.numel()).double()
        self._calls += 1
        if self._calls % self.replace_every:
            return
        self.replace_now()

    def replace_now(self) -> list[tuple[int, int]]:
        """Swap device experts for hotter CPU ones by the live counts; returns ``[(out, in)]``."""
        assert self.device_experts is not None
        swaps = choose_swaps(self._live, self.device_experts.ids, self.replace_margin)
        for out, inn in swaps:
            self.device_experts.remove(out)
            self.device_experts.add(inn, self._expert_weights(inn))
        if swaps:
            self._sync_mask()
            self.replacements += len(swaps)
        # Halve the history so the placement follows a drifting workload rather than the first prompt.
        self._live *= 0.5
        return swaps

    def extra_repr(self) -> str:
        n = self.cpu.experts if self.cpu is not None else 0
        return f"layer={self.layer}, replaces={self.block_class}, experts={n}, on_device={self.device_ids}"
