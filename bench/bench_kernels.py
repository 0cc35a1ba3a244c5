#!/usr/bin/env python3
"""Decode-kernel throughput per method: decoded weights per nanosecond, robust to a shared machine.

One token through one MoE layer whose weights sit in cache (4 experts, hidden 1024, intermediate
256: memory bandwidth and its noise drop out), on one engine thread. Every call is timed on its
own and the MINIMUM is kept: on a busy machine that is a call nobody interrupted (the median shows
the noise). The layer runs with 2 and with 4 of its experts routed; the difference in weights over
the difference in minimum time is the kernels' marginal speed ("w/ns"), free of the fixed cost
of a call (routing, activation quantization, Python). The per-call figure keeps that cost in.
Optionally the same at a real shape (Qwen3-30B-A3B: 128 experts, top-8, hidden 2048,
intermediate 768), where the weights stream from DRAM: GB/s of expert bytes touched.

    python bench/bench_kernels.py                          # all engine methods, cache-resident
    python bench/bench_kernels.py --methods int4,mxfp4 --isa avx2 --json k.json
    python bench/bench_kernels.py --real --threads 2       # add the real shape
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from hetmoe.bench.layers import random_projection
from hetmoe.kernels import select_isa, set_num_threads
from hetmoe.runtime import CPUExperts

METHODS = (
    "bf16,int8,int4,int4-asym,gptq,mxfp4,fp8,fp8-channel,"
    "gguf:q8_0,gguf:q4_0,gguf:iq4_nl,gguf:q4_k,gguf:q5_k,gguf:q6_k,gguf:iq4_xs"
)


def _layer(method: str, experts: int, hidden: int, inter: int) -> CPUExperts:
    group = 32 if method in ("int4", "int4-asym", "gptq") else 128
    projs = [
        random_projection(method, experts, n, k, group, seed)
        for seed, (n, k) in enumerate(((inter, hidden), (inter, hidden), (hidden, inter)))
    ]
    return CPUExperts(*projs, verbose=False)


def _times(fn, calls: int, rounds: int) -> list[float]:
    """Seconds of each of calls * rounds calls, timed one by one: on a shared machine the minimum
    is a call that nobody interrupted, which an average over a round of calls rarely is."""
    out = []
    gc.disable()  # a collection inside a timed call is Python's cost, not the kernel's
    try:
        for _ in range(rounds):
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return out


def _timed_layer(
    ce: CPUExperts, experts: int, topk: int, hidden: int, calls: int, rounds: int, reroute: bool = False
) -> list[float]:
    """`reroute`: a fresh random choice of experts per call, so the weights come from DRAM."""
    g = torch.Generator().manual_seed(topk)
    x = torch.randn(1, hidden, generator=g)
    routes = [torch.randperm(experts, generator=g)[:topk].view(1, topk) for _ in range(64 if reroute else 1)]
    w = torch.rand(1, topk, generator=g)
    ce.forward(x, routes[0], w)  # warm: pages, caches, pool
    it = iter(range(1 << 62))
    return _times(lambda: ce.forward(x, routes[next(it) % len(routes)], w), calls, rounds)


def measure(method: str, experts: int, topk: int, hidden: int, inter: int, calls: int, rounds: int) -> dict:
    """One token routed to `topk` experts; with `topk` >= 4 also to topk / 2 for the marginal speed."""
    ce = _layer(method, experts, hidden, inter)
    per_expert = 3 * hidden * inter
    bytes_per_weight = sum(_proj_bytes(q) for q in (ce.gate, ce.up, ce.down)) / (experts * per_expert)
    full = _timed_layer(ce, experts, topk, hidden, calls, rounds, reroute=experts > 8)
    best = min(full)
    r = {
        "method": method,
        "weights_per_call": topk * per_expert,
        "bytes_per_weight": bytes_per_weight,
        "min_us": best * 1e6,
        "median_us": statistics.median(full) * 1e6,
        "call_weights_per_ns": topk * per_expert / (best * 1e9),
        "gb_per_s_min": topk * per_expert * bytes_per_weight / best / 1e9,
        "gb_per_s_median": topk * per_expert * bytes_per_weight / statistics.median(full) / 1e9,
    }
    if topk >= 4 and experts <= 8:
        half = min(_timed_layer(ce, experts, topk // 2, hidden, calls, rounds))
        r["weights_per_ns"] = (topk - topk // 2) * per_expert / (max(best - half, 1e-9) * 1e9)
    return r


def _proj_bytes(q) -> int:
    return sum(t.numel() * t.element_size() for t in q.tensors.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=METHODS, help="comma-separated engine methods (default: all)")
    ap.add_argument("--isa", default="auto", help="kernel variant: auto, avx2, avx512, amx")
    ap.add_argument("--threads", type=int, default=1, help="engine threads (default 1: per-core figures)")
    ap.add_argument("--calls", type=int, default=30, help="calls per timing round")
    ap.add_argument("--rounds", type=int, default=10, help="timing rounds (calls * rounds calls are timed)")
    ap.add_argument("--real", action="store_true", help="also the Qwen3-30B-A3B shape (128 experts, top-8)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    select_isa(args.isa)
    set_num_threads(args.threads)
    shapes = [("cache", 4, 4, 1024, 256)]
    if args.real:
        shapes.append(("real", 128, 8, 2048, 768))
    results = []
    head = ("shape", "method", "B/w", "min us", "med us", "w/ns", "call w/ns", "GB/s min", "GB/s med")
    print("{:5} {:12} {:>5} {:>8} {:>8} {:>6} {:>9} {:>8} {:>8}".format(*head))
    for label, experts, topk, hidden, inter in shapes:
        for method in args.methods.split(","):
            calls = args.calls if label == "cache" else max(5, args.calls // 5)
            r = measure(method, experts, topk, hidden, inter, calls, args.rounds)
            r.update(shape=label, isa=args.isa, threads=args.threads)
            results.append(r)
            marginal = f"{r['weights_per_ns']:6.2f}" if "weights_per_ns" in r else f"{'-':>6}"
            print(
                f"{label:5} {method:12} {r['bytes_per_weight']:5.3f} {r['min_us']:8.1f} {r['median_us']:8.1f} "
                f"{marginal} {r['call_weights_per_ns']:9.2f} {r['gb_per_s_min']:8.2f} {r['gb_per_s_median']:8.2f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
