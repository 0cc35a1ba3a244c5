"""Layerwise prefill: above a token threshold, a layer's CPU experts are streamed to the device.

A long prompt makes every expert of a layer busy with many tokens: the layer is then compute-bound,
and the device computes it far faster than the CPU engine, even counting the time to bring the
weights over. So for a forward of more than ``threshold`` tokens each MoE layer computes all its
routed experts on the device: the resident ones (``DeviceExperts``) as they are, the others
streamed from the CPU engine's stored bytes (the ``QuantizedTensor`` each CPUExperts holds, so in
their stored precision: an int4 layer moves a quarter of the bf16 bytes) in chunks of experts,
each chunk copied to the device and dequantized there to the model's dtype. Every (token, expert)
pair is computed exactly once (``compute_layer``; ``streamed_counts`` and the device experts'
counts add up to the routing).

Overlap. A producer thread walks the MoE layers in order, preparing (copying and dequantizing)
chunk after chunk, while the forward consumes them: the next chunk, and after a layer's last chunk
the NEXT layer's first chunks, are prepared while this layer computes. The next layer's routing is
not known yet, so the producer prepares all of its non-resident experts. On a CUDA device the
producer issues its copies and dequantization on its own stream and the forward waits on an event
per chunk; on device "cpu" the overlap is the thread dequantizing ahead (torch releases the GIL).

Device working set. At most ``depth`` (2) prepared or in-use chunks exist at a time: the producer
takes a permit before preparing a chunk and the forward returns it once that chunk's computation
has finished on the device (on CUDA: the producer waits for an event recorded after it). A chunk
holds at most ``max(chunk_bytes, one expert)`` of dequantized weights, so the streamed weights on
the device never exceed ``depth * max(chunk_bytes, one expert)`` plus the stored (quantized) copy of
the chunk being dequantized, which is freed right after (default ``chunk_bytes`` 512 MiB: at most
1 GiB of dequantized weights plus one chunk's stored bytes; a bf16 model: DeepSeek-V3's experts
are 84 MiB, 6 a chunk, Qwen3-30B-A3B's 9 MiB, 56 a chunk). Activations come on top: a chunk's
expert computes its tokens' ``[tokens, intermediate]`` gate, up and product.

``events`` logs ``(what, layer, chunk, chunks_in_layer)`` with ``what`` one of ``prepare_start``,
``prepare_end``, ``compute_start``, ``compute_end``: the order in which the two sides ran.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..formats import QuantizedTensor, get_codec
from .device_experts import DeviceExperts
from .torch_experts import ExpertWeights, run_experts

DEFAULT_CHUNK_BYTES = 512 << 20
DEFAULT_DEPTH = 2
_POLL_S = 0.2  # how often a blocked side looks at whether the other side is gone


class StreamSource(Protocol):
    """What the producer reads from a layer (HybridMoE): its stored experts and which are resident."""

    layer: int
    compute_dtype: torch.dtype
    device: torch.device
    biases: dict[str, torch.Tensor]
    cpu: Any  # ExpertBackend: .gate/.up/.down QuantizedTensors [E, ...]

    @property
    def device_ids(self) -> list[int]: ...


@dataclass
class Chunk:
    layer: int
    index: int
    count: int  # chunks in this layer
    weights: dict[int, ExpertWeights]
    device: torch.device
    ready: Any = None  # torch.cuda.Event on CUDA: the producer's stream finished preparing it
    nbytes: int = 0


@dataclass
class _LayerEnd:
    layer: int


@dataclass
class _Failure:
    error: BaseException


@dataclass
class LayerwiseStats:
    """Totals since the runtime was loaded: chunks and bytes streamed, time on each side."""

    layers: int = 0
    chunks: int = 0
    experts: int = 0
    stored_bytes: int = 0  # bytes copied to the device (the stored, possibly quantized, form)
    device_bytes: int = 0  # dequantized bytes produced on the device
    prepare_s: float = 0.0  # producer: copying and dequantizing
    starved_s: float = 0.0  # forward: blocked waiting for a chunk the producer had not finished
    peak_live_bytes: int = 0  # most dequantized chunk bytes alive at once
    _live: int = field(default=0, repr=False)


def expert_bytes(src: StreamSource) -> int:
    """Dequantized bytes of one expert of ``src`` in the model's dtype (weights and biases)."""
    _, i, h = src.cpu.gate.shape
    size = torch.empty((), dtype=src.compute_dtype).element_size()
    biases = sum(b[0].numel() for b in src.biases.values())
    return (3 * i * h + biases) * size


def plan_chunks(src: StreamSource, chunk_bytes: int) -> list[list[int]]:
    """The layer's non-resident experts in ascending id order, cut into chunks of at most
    ``chunk_bytes`` dequantized bytes (at least one expert a chunk)."""
    resident = set(src.device_ids)
    todo = [e for e in range(int(src.cpu.gate.shape[0])) if e not in resident]
    per_chunk = max(1, chunk_bytes // max(1, expert_bytes(src)))
    return [todo[i : i + per_chunk] for i in range(0, len(todo), per_chunk)]


def _take(t: torch.Tensor, experts: list[int], device: torch.device) -> torch.Tensor:
    """Rows ``experts`` of a stacked ``[E, ...]`` tensor on ``device`` (one slice when they are consecutive)."""
    first = experts[0]
    if experts == list(range(first, first + len(experts))):
        part = t[first : first + len(experts)]
    else:
        part = t.index_select(0, torch.tensor(experts, dtype=torch.long))
    return part.to(device, non_blocking=True)


def dequantize_on_device(
    q: QuantizedTensor, experts: list[int], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, int]:
    """``experts`` of the stacked ``q``, their stored tensors copied to ``device`` and dequantized there.

    Returns ``(weights [n, N, K] in dtype, stored bytes copied)``. A codec that cannot run on the
    device (one keeping a lookup table on the CPU) is dequantized on the CPU and the result copied.
    """
    stored = {s: _take(t, experts, device) for s, t in q.tensors.items()}
    copied = sum(t.numel() * t.element_size() for t in stored.values())
    codec = get_codec(q.method, **q.params)
    chunk = QuantizedTensor(q.method, (len(experts), *q.shape[1:]), stored, q.params)
    try:
        return codec.dequantize(chunk, dtype), copied
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:  # e.g. mxfp4 indexes its CPU value table with the codes
        if device.type == "cpu":
            raise
        on_cpu = QuantizedTensor(q.method, chunk.shape, {s: t.cpu() for s, t in stored.items()}, q.params)
        return codec.dequantize(on_cpu, dtype).to(device), copied


def prepare_chunk(src: StreamSource, experts: list[int]) -> tuple[dict[int, ExpertWeights], int, int]:
    """``({expert: weights on the device}, stored bytes copied, dequantized bytes)`` for one chunk."""
    dtype, device = src.compute_dtype, src.device
    (gate, g), (up, u), (down, d) = (
        dequantize_on_device(q, experts, dtype, device) for q in (src.cpu.gate, src.cpu.up, src.cpu.down)
    )
    copied = g + u + d
    biases: dict[str, torch.Tensor] = {}
    for name, b in src.biases.items():
        biases[name] = _take(b, experts, device).to(dtype)
        copied += biases[name].numel() * b.element_size()
    out = {
        e: ExpertWeights(
            gate[j], up[j], down[j], *(biases[n][j] if n in biases else None for n in ("gate", "up", "down"))
        )
        for j, e in enumerate(experts)
    }
    made = sum(t.numel() * t.element_size() for t in (gate, up, down, *biases.values()))
    return out, copied, made


class _Pass:
    """One walk of the producer over the MoE layers, from the layer that started it to the last."""

    def __init__(self, order: list[int], start: int) -> None:
        self.layers = order[order.index(start) :]
        self.expected = start  # the layer the forward will ask for next
        self.ready: queue.Queue[Chunk | _LayerEnd | _Failure] = queue.Queue()
        self.permits: queue.Queue[Any] = queue.Queue()
        self.cancel = threading.Event()
        self.thread: threading.Thread | None = None

    def next_layer(self, layer: int) -> int | None:
        i = self.layers.index(layer) + 1
        return self.layers[i] if i < len(self.layers) else None


class LayerwisePrefill:
    """The runtime-wide streamer: one per loaded model, shared by its HybridMoE layers."""

    def __init__(
        self,
        layers: dict[int, StreamSource],
        threshold: int,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        depth: int = DEFAULT_DEPTH,
    ) -> None:
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0:
            raise ValueError(f"prefill_threshold: expected an int >= 0 (tokens), found {threshold!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"prefill_chunk_bytes: expected an int >= 1, found {chunk_bytes!r}")
        if depth < 2:
            raise ValueError(f"depth: expected >= 2 (one chunk computing, one being prepared), found {depth}")
        self.threshold = threshold
        self.chunk_bytes = chunk_bytes
        self.depth = depth
        self.order = sorted(layers)
        # Weak references: a producer blocked on a permit must not keep a dropped model alive.
        self._sources = {layer: weakref.ref(src) for layer, src in layers.items()}
        self._pass: _Pass | None = None
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self.stats = LayerwiseStats()
        self.events: collections.deque[tuple[str, int, int, int]] = collections.deque(maxlen=8192)

    def applies(self, tokens: int) -> bool:
        return tokens > self.threshold

    def working_set_bytes(self) -> int:
        """The bound on streamed, dequantized weights alive on the device at once (see the module doc)."""
        per = max((expert_bytes(s) for r in self._sources.values() if (s := r()) is not None), default=0)
        return self.depth * max(self.chunk_bytes, per)

    # --- producer ------------------------------------------------------------------------------

    def _start(self, layer: int) -> _Pass:
        self.close()
        p = _Pass(self.order, layer)
        for _ in range(self.depth):
            p.permits.put(None)
        src = self._sources[layer]()
        device = src.device if src is not None else torch.device("cpu")
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        p.thread = threading.Thread(
            target=_produce, args=(weakref.ref(self), p, stream), name=f"hetmoe-prefill-{layer}", daemon=True
        )
        self._pass = p
        p.thread.start()
        return p

    def close(self) -> None:
        """Stop the producer of the current pass (if any) and drop what it prepared."""
        p, self._pass = self._pass, None
        if p is None:
            return
        p.cancel.set()
        if p.thread is not None and p.thread is not threading.current_thread():
            p.thread.join()
        while not p.ready.empty():
            item = p.ready.get_nowait()
            if isinstance(item, Chunk):
                with self._stats_lock:
                    self.stats._live -= item.nbytes

    def __del__(self) -> None:
        p = getattr(self, "_pass", None)
        if p is not None:
            p.cancel.set()

    # --- consumer ------------------------------------------------------------------------------

    def layer_chunks(self, layer: int) -> Iterator[Chunk]:
        """The chunks of ``layer`` as the producer finishes them. A chunk's permit goes back when
        the caller asks for the next one (so: after computing it), or when the iteration ends; an
        iteration that ends early (an error while computing) stops the pass, so the next forward
        starts a fresh one instead of resuming in the middle of a layer."""
        with self._lock:
            p = self._pass
            if p is None or p.expected != layer or p.cancel.is_set():
                p = self._start(layer)  # a new forward, or a previous one that stopped midway
        finished = False
        try:
            while True:
                item = self._get(p, layer)
                if isinstance(item, _LayerEnd):
                    p.expected = p.next_layer(layer)
                    finished = True
                    return
                _wait_ready(item)
                try:
                    yield item
                finally:
                    self._release(p, item)
        finally:
            if not finished and self._pass is p:
                self.close()

    def _get(self, p: _Pass, layer: int) -> Chunk | _LayerEnd:
        started = time.perf_counter()
        while True:
            try:
                item = p.ready.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if p.thread is not None and not p.thread.is_alive() and p.ready.empty():
                    raise RuntimeError(f"layerwise prefill: the producer stopped before layer {layer}") from None
        self.stats.starved_s += time.perf_counter() - started
        if isinstance(item, _Failure):
            raise RuntimeError(f"layerwise prefill: preparing layer {layer}'s experts failed: {item.error}") from (
                item.error
            )
        if item.layer != layer:  # cannot happen: a pass is only reused when it expects this layer
            raise RuntimeError(f"layerwise prefill: expected layer {layer}'s experts, the producer made {item.layer}'s")
        return item

    def _release(self, p: _Pass, item: Chunk) -> None:
        done = None
        if item.ready is not None:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(item.device))
        with self._stats_lock:
            self.stats._live -= item.nbytes
        item.weights.clear()
        p.permits.put(done)

    def log(self, what: str, layer: int, chunk: int, count: int) -> None:
        self.events.append((what, layer, chunk, count))


def _wait_ready(item: Chunk) -> None:
    """On CUDA: order the forward's stream after the producer's work on this chunk."""
    if item.ready is None:
        return
    stream = torch.cuda.current_stream(item.device)
    stream.wait_event(item.ready)
    for w in item.weights.values():
        for t in (w.gate, w.up, w.down, w.gate_bias, w.up_bias, w.down_bias):
            if t is not None:
                t.record_stream(stream)  # made on the producer's stream, used on this one


def _produce(owner_ref: weakref.ref[LayerwisePrefill], p: _Pass, stream: Any) -> None:
    """The producer thread's body: every chunk of every layer of the pass, in order."""
    try:
        for layer in p.layers:
            owner = owner_ref()
            src = owner._sources[layer]() if owner is not None else None
            if src is None:
                return
            plan = plan_chunks(src, owner.chunk_bytes)
            del owner, src  # hold nothing strong while blocked on a permit
            for index, experts in enumerate(plan):
                done = _permit(p, owner_ref)
                if done is _STOP:
                    return
                if done is not None:
                    done.synchronize()  # the device finished computing the chunk this permit freed
                owner = owner_ref()
                src = owner._sources[layer]() if owner is not None else None
                if owner is None or src is None:
                    return
                owner.log("prepare_start", layer, index, len(plan))
                started = time.perf_counter()
                ready = None
                if stream is not None:
                    with torch.cuda.stream(stream):
                        weights, copied, made = prepare_chunk(src, experts)
                        ready = torch.cuda.Event()
                        ready.record(stream)
                else:
                    weights, copied, made = prepare_chunk(src, experts)
                with owner._stats_lock:
                    s = owner.stats
                    s.prepare_s += time.perf_counter() - started
                    s.chunks += 1
                    s.experts += len(experts)
                    s.stored_bytes += copied
                    s.device_bytes += made
                    s._live += made
                    s.peak_live_bytes = max(s.peak_live_bytes, s._live)
                owner.log("prepare_end", layer, index, len(plan))
                p.ready.put(Chunk(layer, index, len(plan), weights, src.device, ready, made))
                del owner, src, weights
            p.ready.put(_LayerEnd(layer))
    except BaseException as exc:  # handed to the forward, which raises it
        p.ready.put(_Failure(exc))


_STOP = object()


def _permit(p: _Pass, owner_ref: Callable[[], Any]) -> Any:
    while not p.cancel.is_set():
        try:
            return p.permits.get(timeout=_POLL_S)
        except queue.Empty:
            if owner_ref() is None:
                break
    return _STOP


def compute_layer(
    prefill: LayerwisePrefill,
    layer: int,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    resident: DeviceExperts,
    fetch_now: Callable[[int], ExpertWeights],
    counts: torch.Tensor,
) -> torch.Tensor:
    """All routed experts of ``layer`` for ``x [T, H]`` on its device, summed in fp32, returned in x's dtype.

    The device-resident experts (``resident``) are computed as they are; the streamed chunks give
    the rest, each expert of a chunk computed unless it became resident meanwhile; an expert in
    neither (the placement changed after the producer planned the layer) is dequantized here with
    ``fetch_now``. ``counts [E]`` gets the tokens of every expert computed from a chunk or
    ``fetch_now`` (the resident ones count in ``resident.counts``).
    """
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    done = set(resident.ids)
    if done:
        y += resident.forward(x, ids, weights).float()
    for chunk in prefill.layer_chunks(layer):
        prefill.log("compute_start", layer, chunk.index, chunk.count)
        todo = {e: w for e, w in chunk.weights.items() if e not in done}
        y += run_experts(x, ids, weights, todo.get, resident.act, counts).float()
        done.update(todo)
        prefill.log("compute_end", layer, chunk.index, chunk.count)
    for e in torch.unique(ids).tolist():
        if e >= 0 and e not in done:
            y += run_experts(x, ids, weights, {e: fetch_now(e)}.get, resident.act, counts).float()
    prefill.stats.layers += 1
    return y.to(x.dtype)
