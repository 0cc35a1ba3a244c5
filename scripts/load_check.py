#!/usr/bin/env python
"""Load check for ``hetmoe serve``: many concurrent streaming clients, then the same work one at a time.

Phase 1 runs ``--concurrency`` clients (default 32) for ``--duration`` seconds (default 120), each
sending streamed chat completions back to back (fixed length: ``ignore_eos``, ``--max-tokens``).
Phase 2 runs the same requests with one client for ``--baseline-duration`` seconds. It reports
errors, requests, generated tokens/s, p50/p95 time to first token and inter-token latency, the
server's resident memory at start, after ``--warmup`` seconds and at the end (it should stay flat
after warm-up), and the batching speed-up (phase 1 tokens/s over phase 2's).

Without ``--url`` it starts ``hetmoe serve`` (the embedded default model, or ``--model-dir``) as a
child process on a free loopback port, so the clients' own work does not share the server's
interpreter, and reads the server's memory from /proc (psutil). With ``--url`` memory is reported
only when ``--server-pid`` names the server's process.

A soak (32 clients for 10 minutes, every 8th request dropped by its client after its first tokens;
fails if the server's mean RSS over the last minute is more than 1% above its mean over the minute
after a minute of warm-up):
  python scripts/load_check.py --duration 600 --warmup 60 --disconnect-every 8 --no-baseline --max-growth 1

examples:
  python scripts/load_check.py
  python scripts/load_check.py --duration 20 --baseline-duration 10 --json load.json
  python scripts/load_check.py --url http://127.0.0.1:8000 --server-pid 1234 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "Tell me a story about a fox.",
    "What is the capital of France?",
    "Explain mixture-of-experts models in simple words.",
    "Count from one to twenty.",
    "Write a short poem about the sea.",
    "Why is the sky blue?",
    "List five fruits and their colours.",
    "Describe your favourite book.",
]


@dataclass
class Phase:
    concurrency: int
    duration_s: float = 0.0
    requests: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    disconnected: int = 0  # requests the client dropped mid-stream on purpose (--disconnect-every)

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(text[:300])

    def summary(self) -> dict[str, Any]:
        def pct(values: list[float], q: int) -> float | None:
            if len(values) < 2:
                return round(1000 * values[0], 3) if values else None
            return round(1000 * statistics.quantiles(values, n=100, method="inclusive")[q - 1], 3)

        return {
            "concurrency": self.concurrency,
            "duration_s": round(self.duration_s, 2),
            "requests": self.requests,
            "disconnected_mid_stream": self.disconnected,
            "errors": self.errors,
            "error_samples": self.error_samples,
            "completion_tokens": self.completion_tokens,
            "tokens_per_s": round(self.completion_tokens / self.duration_s, 2) if self.duration_s else None,
            "requests_per_s": round(self.requests / self.duration_s, 3) if self.duration_s else None,
            "ttft_p50_ms": pct(self.ttft, 50),
            "ttft_p95_ms": pct(self.ttft, 95),
            "ttft_p99_ms": pct(self.ttft, 99),
            "itl_p50_ms": pct(self.itl, 50),
            "itl_p95_ms": pct(self.itl, 95),
            "itl_p99_ms": pct(self.itl, 99),
        }


async def one_request(
    http: httpx.AsyncClient, model: str, prompt: str, args: argparse.Namespace, phase: Phase, drop: bool = False
) -> None:
    """One streamed request; ``drop``: the client closes the stream after its second piece of text."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    last = None
    ttft = None
    gaps: list[float] = []
    usage = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                phase.error(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    phase.error(json.dumps(chunk["error"]))
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    if ttft is None:
                        ttft = now - start
                    else:
                        gaps.append(now - last)
                    last = now
                    if drop and gaps:  # leaving the `async with` closes the connection mid-stream
                        phase.disconnected += 1
                        return
    except (httpx.HTTPError, ValueError) as exc:
        phase.error(f"{type(exc).__name__}: {exc}")
        return
    if usage is None or ttft is None:
        phase.error("the stream ended without usage or without any text")
        return
    phase.requests += 1
    phase.completion_tokens += int(usage["completion_tokens"])
    phase.ttft.append(ttft)
    phase.itl.extend(gaps)


async def run_phase(
    url: str, key: str | None, model: str, concurrency: int, duration: float, args: argparse.Namespace
) -> Phase:
    phase = Phase(concurrency)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    deadline = time.perf_counter() + duration

    async def client(i: int, http: httpx.AsyncClient) -> None:
        n, sent = i, 0
        while time.perf_counter() < deadline:
            # each client drops every Nth of its own requests, the clients staggered
            drop = args.disconnect_every > 0 and (sent + i) % args.disconnect_every == args.disconnect_every - 1
            await one_request(http, model, PROMPTS[n % len(PROMPTS)], args, phase, drop)
            n += concurrency
            sent += 1

    started = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
    phase.duration_s = time.perf_counter() - started  # requests in flight at the deadline are finished and counted
    return phase


async def alive_after(url: str, key: str | None, model: str, args: argparse.Namespace) -> bool:
    """The server survived the load (and any dropped streams): one more request completes."""
    phase = Phase(1)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(600.0)) as http:
        await one_request(http, model, PROMPTS[0], args, phase)
    return phase.requests == 1 and not phase.errors


class MemoryWatch:
    """The server's RSS, sampled every second on a thread, and every fifth second the bytes its
    engine's job-buffer cache holds (the hetmoe_engine_buffer_cache_bytes gauge of /metrics): the
    part of the RSS that is buffers kept for reuse."""

    def __init__(self, pid: int | None, metrics_url: str | None = None, headers: dict[str, str] | None = None) -> None:
        self.metrics_url, self.headers = metrics_url, headers or {}
        self.cache_samples: list[tuple[float, int]] = []
        self.proc = None
        if pid is not None:
            import psutil

            self.proc = psutil.Process(pid)
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int | None:
        try:
            return int(self.proc.memory_info().rss) if self.proc is not None else None
        except Exception:
            return None

    def cached(self) -> int | None:
        try:
            text = httpx.get(self.metrics_url, headers=self.headers, timeout=5).text
        except httpx.HTTPError:
            return None
        found = re.search(r"^hetmoe_engine_buffer_cache_bytes (\S+)$", text, re.MULTILINE)
        return int(float(found.group(1))) if found else None

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(1.0):
            value = self.rss()
            if value is not None:
                self.samples.append((time.perf_counter(), value))
            tick += 1
            if self.metrics_url and tick % 5 == 0 and (cached := self.cached()) is not None:
                self.cache_samples.append((time.perf_counter(), cached))

    def start(self) -> MemoryWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "hetmoe.cli.main", "serve"]
    if args.model_dir:
        cmd.append(args.model_dir)
    cmd += ["--port", str(port), "--max-batch", str(max(args.concurrency, 1)), "--max-queue", "1024"]
    cmd += ["--log-level", "warning"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.torch_threads:
        cmd += ["--torch-threads", str(args.torch_threads)]
    if args.method:
        cmd += ["--method", args.method]
    env = dict(os.environ)
    env.pop("HETMOE_API_KEY", None)
    print("starting:", " ".join(cmd), file=sys.stderr)
    proc = subprocess.Popen(cmd, env=env, cwd=Path(__file__).resolve().parent.parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"the server did not answer /health within {args.start_timeout} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start hetmoe serve here)")
    p.add_argument("--api-key", default=os.environ.get("HETMOE_API_KEY"), help="bearer key for --url")
    p.add_argument("--server-pid", type=int, help="with --url: the server's pid, to report its memory")
    p.add_argument("--model-dir", help="without --url: serve this model directory or .gguf (default: the embedded one)")
    p.add_argument("--method", choices=("bf16", "int8", "int4"), help="without --url: experts' CPU method")
    p.add_argument("--threads", type=int, help="without --url: CPU engine threads")
    p.add_argument("--torch-threads", type=int, help="without --url: the server's torch intra-op threads")
    p.add_argument("--concurrency", type=int, default=32, help="concurrent streaming clients (default 32)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of concurrent load (default 120)")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds after which memory should stay flat (10)")
    p.add_argument("--baseline-duration", type=float, default=30.0, help="seconds of one-at-a-time load (30)")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-at-a-time phase")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument(
        "--disconnect-every",
        type=int,
        default=0,
        metavar="N",
        help="every Nth request is dropped by its client mid-stream (default 0: none)",
    )
    p.add_argument(
        "--max-growth",
        type=float,
        default=None,
        metavar="PCT",
        help="fail if the server's RSS grows more than PCT percent after warm-up",
    )
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for the server to start")
    p.add_argument("--json", metavar="FILE", help="write the report as JSON")
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.duration <= 0 or args.max_tokens < 1:
        p.error("--concurrency, --duration and --max-tokens must be positive")

    proc = None
    if args.url:
        url, pid = args.url.rstrip("/").removesuffix("/v1"), args.server_pid
    else:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key and args.url else {}
        model = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        key = args.api_key if args.url else None
        watch = MemoryWatch(pid, url + "/metrics", headers).start()
        rss_start = watch.rss()
        print(f"model {model} at {url}: {args.concurrency} clients for {args.duration:.0f} s", file=sys.stderr)
        t0 = time.perf_counter()
        rss_warm: list[int | None] = [None]

        def note_warm() -> None:
            rss_warm[0] = watch.rss()

        timer = threading.Timer(min(args.warmup, args.duration), note_warm)
        timer.start()
        batched = asyncio.run(run_phase(url, key, model, args.concurrency, args.duration, args))
        timer.cancel()
        rss_end = watch.rss()
        after_warm = [v for t, v in watch.samples if t - t0 >= args.warmup]
        alive_check = asyncio.run(alive_after(url, key, model, args))
        sequential = None
        if not args.no_baseline:
            print(f"one client for {args.baseline_duration:.0f} s", file=sys.stderr)
            sequential = asyncio.run(run_phase(url, key, model, 1, args.baseline_duration, args))
        watch.stop()
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    mib = 2**20
    report: dict[str, Any] = {
        "url": url,
        "model": model,
        "max_tokens": args.max_tokens,
        "batched": batched.summary(),
        "sequential": sequential.summary() if sequential else None,
        "alive_after": alive_check,
        "rss_samples_mib": [(round(t - t0, 1), round(v / 2**20, 1)) for t, v in watch.samples],
        "buffer_cache_samples_mib": [(round(t - t0, 1), round(v / 2**20, 1)) for t, v in watch.cache_samples],
        "rss_mib": {
            "start": rss_start / mib if rss_start else None,
            "after_warmup": rss_warm[0] / mib if rss_warm[0] else None,
            "end": rss_end / mib if rss_end else None,
            "max_after_warmup": max(after_warm) / mib if after_warm else None,
            "min_after_warmup": min(after_warm) / mib if after_warm else None,
        },
    }
    b = report["batched"]["tokens_per_s"]
    s = report["sequential"]["tokens_per_s"] if sequential else None
    report["speedup"] = round(b / s, 2) if b and s else None

    r = report["rss_mib"]
    print(json.dumps(report["batched"], indent=1))
    if sequential:
        print(json.dumps(report["sequential"], indent=1))
    print(
        f"tokens/s: {b} with {args.concurrency} clients"
        + (f", {s} one at a time: speed-up {report['speedup']}x" if s else "")
    )
    if r["start"] is not None:
        print(
            f"server RSS MiB: start {r['start']:.0f}, after warm-up {r['after_warmup'] or 0:.0f}, "
            f"end {r['end'] or 0:.0f}"
            f" (after warm-up min {r['min_after_warmup'] or 0:.0f} / max {r['max_after_warmup'] or 0:.0f})"
        )
    # Growth: the mean RSS of the last minute against the mean of the minute after warm-up (single
    # samples move by a few MB as buffers come and go; a leak moves the mean)
    t_end = watch.samples[-1][0] - t0 if watch.samples else 0.0
    first = [v for t, v in watch.samples if args.warmup <= t - t0 < args.warmup + 60]
    last = [v for t, v in watch.samples if t - t0 >= max(t_end - 60, args.warmup + 60)]
    warm, end = (statistics.mean(first) / mib if first else None), (statistics.mean(last) / mib if last else None)
    growth = (end - warm) / warm * 100 if warm and end else None
    report["rss_mib"]["mean_minute_after_warmup"] = round(warm, 1) if warm else None
    report["rss_mib"]["mean_last_minute"] = round(end, 1) if end else None
    report["rss_growth_after_warmup_percent"] = round(growth, 2) if growth is not None else None
    print(f"alive after the load: {alive_check}; RSS growth after warm-up: {growth:+.2f}%" if growth is not None
          else f"alive after the load: {alive_check}")  # fmt: skip
    if args.json:
        tmp = Path(args.json).with_name(Path(args.json).name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        tmp.replace(args.json)
    too_much = args.max_growth is not None and (growth is None or growth > args.max_growth)
    return 1 if batched.errors or (sequential and sequential.errors) or not alive_check or too_much else 0


if __name__ == "__main__":
    sys.exit(main())
