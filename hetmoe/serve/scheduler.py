"""Continuous batching: one worker thread owns the model and runs every request through it.

Requests wait in a FIFO queue (bounded: ``submit`` raises :class:`QueueFull` beyond
``max_queue`` waiting requests). Each turn of the worker loop:

1. admits waiting requests in arrival order while fewer than ``max_batch`` are running, and
   prefills each alone (a one-request forward over its prompt into its own cache; the first token
   comes out of it), then adds its cache as a row of the padded batch (kv_batch.PaddedBatch);
2. drops the rows whose clients went away (their cache rows are freed at once);
3. runs ONE decode forward over all running rows, samples each row's next token with its own
   parameters and generator, and removes the rows that finished (stop, length, end of sequence).

Requests therefore join after their prefill and leave when done, never waiting for each other.
When the model's cache cannot be padded into a batch (sliding-window or linear-attention layers),
each running request keeps its own cache and the step runs one forward per request instead.

Results leave through each request's ``sink`` (called on the worker thread) as :class:`Delta`,
:class:`Finished` or :class:`Failed` events. An exception in a prefill fails that request; one in a
decode forward fails the requests of that forward (which row caused it cannot be told) and clears
the batch; the worker itself keeps serving. A lost expert rank (RankLostError) also marks the
scheduler ``broken``: /health then answers 503 until the job is restarted.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..models.loader import release_freed_memory
from ..runtime.process_group import RankLostError
from .kv_batch import PaddedBatch, batchable
from .metrics import Metrics
from .sampling import NGramBan, SamplingParams, SeenTokens, make_generator, sample_token
from .stops import OutputText

log = logging.getLogger("hetmoe.serve")
TRIM_EVERY_S = 5.0


@dataclass
class Delta:
    text: str


@dataclass
class Finished:
    reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    message: str


Event = Delta | Finished | Failed


class QueueFull(Exception):
    pass


class SchedulerStopped(Exception):
    pass


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request as the scheduler sees it."""

    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Event], None]
    arrived: float = field(default_factory=time.perf_counter)
    number: int = field(default_factory=lambda: next(_ids))
    # set by the HTTP side, read by the worker between steps
    cancelled: bool = False
    # worker state
    generated: list[int] = field(default_factory=list)
    output: OutputText | None = None
    generator: torch.Generator | None = None
    seen: SeenTokens | None = None  # the prompt's and output's tokens, for the repetition penalty
    ngrams: NGramBan | None = None  # their n-grams, for no_repeat_ngram_size
    cache: Any = None  # its own cache, only when the model's caches cannot be batched
    last_token_at: float = 0.0
    done: bool = False
    # a Finished or Failed went to the sink: nothing more does (Scheduler._emit)
    closed: bool = False


class Scheduler:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        eos_ids: frozenset[int],
        *,
        max_batch: int = 32,
        max_queue: int = 256,
        metrics: Metrics | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self.device = next(model.parameters()).device
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._trimmed_at = time.monotonic()
        self._active: list[Sequence] = []  # admitted and not finished: prefilling or in the batch
        self._running: list[Sequence] = []  # the decode batch, row i = _running[i]
        self._batch = PaddedBatch()
        self._batched: bool | None = None  # decided by the first prefill: can caches be padded into a batch?
        self._stop = False
        # Set when the expert ranks of an expert-parallel model are gone: every forward will fail
        # until the job is restarted, so /health says so (runtime/expert_parallel.py).
        self.broken: str | None = None
        self._thread: threading.Thread | None = None
        # Held across an event's check and delivery: after stop() gives up waiting for a worker that is
        # still mid-step, it fails the sequences while that worker may still emit their Deltas.
        self._emit_lock = threading.Lock()
        # Prefill needs only the last position's logits (generate() asks for the same when it can).
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}

    # --- the HTTP side ------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="hetmoe-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the worker; requests still waiting or running are failed."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._cond:
            left = list(self._waiting) + list(self._active)
            self._waiting.clear()
        for seq in left:
            if not seq.done:
                self._emit(seq, Failed("the server is shutting down"))

    def submit(self, seq: Sequence) -> None:
        with self._cond:
            if not self.alive:
                raise SchedulerStopped("the generation worker is not running")
            # Up to max_queue requests may wait beyond the ones the free batch slots will take next.
            free = max(0, self.max_batch - len(self._active))
            if len(self._waiting) >= self.max_queue + free:
                raise QueueFull(
                    f"{len(self._waiting)} requests are already waiting and all {self.max_batch} batch slots are "
                    f"busy (--max-queue {self.max_queue})"
                )
            self._waiting.append(seq)
            self._cond.notify_all()

    def cancel(self, seq: Sequence) -> None:
        """The client went away: drop the request from the queue now, or from the batch at the next step."""
        with self._cond:
            if seq.done or seq.cancelled:
                return
            seq.cancelled = True
            try:
                self._waiting.remove(seq)
            except ValueError:
                return  # admitted: the worker removes it between steps
            seq.done = True
        with self.metrics.lock:
            self.metrics.cancelled.inc()

    # --- the worker ---------------------------------------------------------------------------

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not self._stop and not self._waiting and not self._running:
                        self._cond.wait()
                    if self._stop:
                        return
                    admitted = []
                    while self._waiting and len(self._active) < self.max_batch:
                        seq = self._waiting.popleft()
                        self._active.append(seq)
                        admitted.append(seq)
                try:
                    for seq in admitted:
                        self._prefill(seq)
                    self._drop_cancelled()
                    if self._running:
                        self._decode_step()
                    self._trim_heap()
                except Exception as exc:  # a bug outside the guarded model calls: fail what is held, keep serving
                    log.error("scheduler error: %s", traceback.format_exc())
                    self._batch.clear()
                    self._running.clear()
                    self._fail_all(list(self._active), exc)

    def _trim_heap(self) -> None:
        """Every TRIM_EVERY_S, hand the heap pages that finished requests freed back to the OS.
        glibc keeps them otherwise (anything under its dynamic mmap threshold, up to 32 MiB a block:
        KV caches, logits, activations), so the server's RSS would climb to the highest memory any
        mix of requests ever needed and stay there (+2% over a 10-minute soak of a Q4_0 GGUF,
        scripts/load_check.py). A trim walks the free chunks: small next to a decode step."""
        now = time.monotonic()
        if now - self._trimmed_at >= TRIM_EVERY_S:
            self._trimmed_at = now
            release_freed_memory()

    def _prefill(self, seq: Sequence) -> None:
        if seq.cancelled:
            self._finish_cancelled(seq)
            return
        from transformers import DynamicCache

        try:
            seq.output = OutputText(self.tokenizer, seq.params.stop, seq.prompt_ids)
            seq.generator = make_generator(seq.params.seed, "cpu")
            cache = DynamicCache(config=self.model.config)
            ids = torch.tensor([seq.prompt_ids], dtype=torch.long, device=self.device)
            mask = torch.ones_like(ids)
            out = self.model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, **self._keep)
            with self.metrics.lock:
                self.metrics.prompt_tokens.inc(len(seq.prompt_ids))
            if self._batched is None:
                self._batched = batchable(cache)
            finished = self._accept(seq, out.logits[0, -1].float().cpu())
        except Exception as exc:
            log.error("prefill failed: %s", traceback.format_exc())
            self._fail(seq, exc)
            return
        if finished:
            return
        if self._batched:
            self._batch.add(cache, len(seq.prompt_ids))
        else:
            seq.cache = cache
        self._running.append(seq)

    def _decode_step(self) -> None:
        rows = list(self._running)
        with self.metrics.lock:
            self.metrics.decode_steps.inc()
            self.metrics.batch_size.observe(len(rows))
        try:
            last = torch.tensor([[seq.generated[-1]] for seq in rows], dtype=torch.long, device=self.device)
            if self._batched:
                mask, positions = self._batch.step_inputs()
                out = self.model(
                    input_ids=last, attention_mask=mask, position_ids=positions, cache=self._batch.cache, use_cache=True
                )
                self._batch.advance(mask)
                logits = out.logits[:, -1]
            else:
                own = zip(last, rows, strict=True)
                step = [self.model(input_ids=t[None], cache=s.cache, use_cache=True) for t, s in own]
                logits = torch.cat([o.logits[:, -1] for o in step])
            # fp32 on the CPU, as generate() compares them; the per-request generators live on the CPU.
            logits = logits.float().cpu()
        except Exception as exc:
            log.error("decode step failed: %s", traceback.format_exc())
            self._batch.clear()
            self._running.clear()
            self._fail_all(rows, exc)
            return
        leaving = []
        for i, seq in enumerate(rows):
            try:
                finished = self._accept(seq, logits[i])
            except Exception as exc:
                log.error("sampling failed: %s", traceback.format_exc())
                self._fail(seq, exc)
                finished = True
            if finished:
                leaving.append(i)
        self._leave(leaving)

    def _accept(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """Sample ``seq``'s next token, send the text it completes; True when ``seq`` finished."""
        assert seq.output is not None and seq.generator is not None
        if seq.seen is None and seq.params.repetition_penalty != 1.0:
            seq.seen = SeenTokens(seq.prompt_ids)
        if seq.ngrams is None and seq.params.no_repeat_ngram_size > 0:
            seq.ngrams = NGramBan(seq.params.no_repeat_ngram_size, seq.prompt_ids)
        token = sample_token(logits, seq.params, seq.generator, seq.seen or (), seq.ngrams)
        for history in (seq.seen, seq.ngrams):
            if history is not None:
                history.add(token)
        now = time.perf_counter()
        with self.metrics.lock:
            self.metrics.generation_tokens.inc()
            if seq.generated:
                self.metrics.itl.observe(now - seq.last_token_at)
            else:
                self.metrics.ttft.observe(now - seq.arrived)
        seq.generated.append(token)
        seq.last_token_at = now
        reason = None
        if token in self.eos_ids and not seq.params.ignore_eos:
            text, _ = seq.output.finish()
            reason = "stop"
        else:
            text, stopped = seq.output.push(token)
            if stopped:
                reason = "stop"
            elif len(seq.generated) >= seq.params.max_tokens:
                rest, stopped = seq.output.finish()
                text += rest
                reason = "stop" if stopped else "length"
        if text:
            self._emit(seq, Delta(text))
        if reason is not None:
            self._complete(seq, Finished(reason, len(seq.prompt_ids), len(seq.generated)))
            return True
        return False

    def _drop_cancelled(self) -> None:
        gone = [i for i, seq in enumerate(self._running) if seq.cancelled]
        for i in gone:
            self._finish_cancelled(self._running[i])
        self._leave(gone)

    def _leave(self, rows: list[int]) -> None:
        if not rows:
            return
        if self._batched:
            self._batch.remove(rows)
        gone = set(rows)
        for i in rows:
            self._running[i].cache = None
        self._running = [s for i, s in enumerate(self._running) if i not in gone]

    # --- endings --------------------------------------------------------------------------------

    def _emit(self, seq: Sequence, event: Event) -> None:
        """Deliver ``event`` unless the sequence already got its last one (Finished or Failed): a
        request's stream ends at its terminal event, whichever thread sends what after it."""
        with self._emit_lock:
            if seq.closed:
                return
            seq.closed = isinstance(event, Finished | Failed)
            try:
                seq.sink(event)
            except Exception:  # the client's event loop is gone: nothing to tell
                log.debug("could not deliver an event: %s", traceback.format_exc())

    def _retire(self, seq: Sequence) -> None:
        with self._cond:
            seq.done = True
            if seq in self._active:
                self._active.remove(seq)

    def _complete(self, seq: Sequence, event: Finished) -> None:
        self._retire(seq)
        with self.metrics.lock:
            self.metrics.finished.inc(reason=event.reason)
        self._emit(seq, event)

    def _finish_cancelled(self, seq: Sequence) -> None:
        self._retire(seq)
        with self.metrics.lock:
            self.metrics.cancelled.inc()

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        if isinstance(exc, RankLostError):
            self.broken = str(exc)
        self._retire(seq)
        with self.metrics.lock:
            self.metrics.failed.inc()
        self._emit(seq, Failed(f"generation failed: {type(exc).__name__}: {exc}"))

    def _fail_all(self, seqs: list[Sequence], exc: BaseException) -> None:
        for seq in seqs:
            if not seq.done:
                self._fail(seq, exc)
