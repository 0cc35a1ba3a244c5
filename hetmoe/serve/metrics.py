"""The server's Prometheus metrics, rendered in the text exposition format (version 0.0.4).

Counters and histograms are updated from the HTTP handlers and the scheduler's worker thread
under one lock; gauges (queue depth, running requests, the model runtime's CPU-expert time) are
read at scrape time from callables, so they are never stale.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: tuple[tuple[str, str], ...] = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _number(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str) -> None:
        self.name = name
        self.help = help

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help)
        self.values: dict[Labels, float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def lines(self) -> list[str]:
        values = self.values or {(): 0.0}
        return [f"{self.name}{_labels(k)} {_number(v)}" for k, v in sorted(values.items())]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]) -> None:
        super().__init__(name, help)
        self.read = read

    def lines(self) -> list[str]:
        return [f"{self.name} {_number(self.read())}"]


class CallbackCounter(Gauge):
    """A counter whose total lives elsewhere (the model runtime's timing)."""

    kind = "counter"


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help)
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break
        self.sum += value
        self.count += 1

    def lines(self) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip(self.buckets, self.counts, strict=True):
            cumulative += n
            out.append(f"{self.name}_bucket{_labels((), (('le', _number(bound)),))} {cumulative}")
        out.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{self.name}_sum {_number(self.sum)}")
        out.append(f"{self.name}_count {self.count}")
        return out


class Metrics:
    """Everything ``/metrics`` reports; ``lock`` guards the counters and histograms."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        p = "hetmoe_"
        self.requests = Counter(p + "requests_total", "HTTP requests answered, by endpoint and status code.")
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens prefilled.")
        self.generation_tokens = Counter(p + "generation_tokens_total", "Tokens generated.")
        self.finished = Counter(p + "requests_finished_total", "Generations finished, by finish reason.")
        self.cancelled = Counter(p + "requests_cancelled_total", "Generations cancelled (the client went away).")
        self.failed = Counter(p + "requests_failed_total", "Generations failed by an error inside the worker.")
        self.decode_steps = Counter(p + "decode_steps_total", "Decode forwards run (one per step, all rows at once).")
        self.ttft = Histogram(p + "time_to_first_token_seconds", "From arrival to the first token.", LATENCY_BUCKETS)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Between consecutive tokens.", LATENCY_BUCKETS)
        self.batch_size = Histogram(p + "decode_batch_size", "Requests in each decode forward.", BATCH_BUCKETS)
        self._gauges: list[_Metric] = []

    def add_gauge(self, name: str, help: str, read: Callable[[], float], counter: bool = False) -> None:
        cls = CallbackCounter if counter else Gauge
        self._gauges.append(cls("hetmoe_" + name, help, read))

    def render(self) -> str:
        with self.lock:
            metrics: list[_Metric] = [
                self.requests,
                self.prompt_tokens,
                self.generation_tokens,
                self.finished,
                self.cancelled,
                self.failed,
                self.decode_steps,
                self.ttft,
                self.itl,
                self.batch_size,
            ]
            lines: list[str] = []
            for m in metrics:
                lines += m.header() + m.lines()  # type: ignore[attr-defined]
        for g in self._gauges:
            lines += g.header() + g.lines()  # type: ignore[attr-defined]
        return "\n".join(lines) + "\n"
