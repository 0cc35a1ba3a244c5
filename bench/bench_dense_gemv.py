#!/usr/bin/env python3
"""One-token GEMV of a large dense weight per GGUF type, against a plain read of the same bytes.

A model's lm_head is its largest single weight a decode token reads: DeepSeek-V2/V3's is
102,400 x 2,048 (V3: 129,280 x 7,168), in Q6_K in the Q4_0 and Q4_K_M files llama-quantize writes.
This times ``CPULinear`` (the engine's dense path, what a GGUF's lm_head runs on) on one bf16 row,
and right before each timing reads the same weight bytes once with the engine's plain read
(``measure_chunked_read``: random 1 MiB pieces of them on its pool, with its prefetching and no
arithmetic, the ceiling ``bench moe``'s %read takes), so the ratio is taken within seconds on a
shared machine. The weight is a random matrix's first 1,024 rows quantized by the codec, tiled to the
full height (quantizing 200 M weights would take minutes and say nothing more), on 2 MiB pages as a
model's weights are (hetmoe/hw/huge_pages.py). (Until 2026-12-07 the ceiling was a scalar loop
without prefetching on 4 KiB pages: 17-18 GB/s on the AMX Xeon, where this one reads ~30.)

    python bench/bench_dense_gemv.py                                   # 102400 x 2048, five types
    python bench/bench_dense_gemv.py --rows 129280 --cols 7168 --methods gguf:q6_k,gguf:q4_k
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hetmoe.formats.base import QuantizedTensor
from hetmoe.formats.registry import get_codec
from hetmoe.kernels import engine_module, set_num_threads
from hetmoe.kernels.machine import PLAIN_READ_CHUNK, cpu_info
from hetmoe.runtime.cpu_linear import CPULinear

METHODS = "gguf:q6_k,gguf:q4_0,gguf:q4_k,gguf:q5_0,gguf:q8_0,int4,int8,bf16"
TILE_ROWS = 1024


def tiled_weight(method: str, rows: int, cols: int) -> QuantizedTensor:
    codec = get_codec(method)
    base = codec.quantize(torch.randn(TILE_ROWS, cols, generator=torch.Generator().manual_seed(0)) * 0.02)
    repeats = -(-rows // TILE_ROWS)
    tensors = {k: t.repeat(repeats, *([1] * (t.dim() - 1)))[:rows] for k, t in base.tensors.items()}
    return QuantizedTensor(base.method, (rows, cols), tensors, dict(base.params)).on_huge_pages()


def measure(method: str, rows: int, cols: int, rounds: int) -> dict[str, float | str]:
    q = tiled_weight(method, rows, cols)
    lin = CPULinear(q)
    codes = max(q.tensors.values(), key=lambda t: t.numel() * t.element_size())  # the weight's bytes
    nbytes = q.nbytes
    x = torch.randn(1, cols, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            lin(x)
        gemv, read = [], []
        size = codes.numel() * codes.element_size()
        chunk = min(PLAIN_READ_CHUNK, size // 64 * 64)
        for r in range(rounds):  # alternate: a plain read of the same bytes, then the GEMV
            read.append(
                engine_module().measure_chunked_read(codes.data_ptr(), size, chunk, size // chunk * chunk, 1, r)
            )
            t = time.perf_counter()
            lin(x)
            gemv.append(nbytes / (time.perf_counter() - t) / 1e9)
    g, r = statistics.median(gemv), statistics.median(read)
    return {
        "method": method,
        "mb": nbytes / 1e6,
        "gemv_gb_s": g,
        "read_gb_s": r,
        "ms": nbytes / g / 1e6,
        "pct_read": 100 * g / r,
    }


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--rows", type=int, default=102400, help="output features (default 102400: DeepSeek-V2's vocabulary)"
    )
    p.add_argument("--cols", type=int, default=2048, help="input features (default 2048)")
    p.add_argument("--methods", default=METHODS, help=f"comma-separated engine methods (default {METHODS})")
    p.add_argument("--threads", type=int, default=0, help="engine threads (default: all usable CPUs)")
    p.add_argument("--rounds", type=int, default=30, help="alternating read/GEMV pairs per method (default 30)")
    p.add_argument("--json", type=Path, help="write the records here")
    args = p.parse_args()
    threads = args.threads or max(1, cpu_info().usable_cpus)
    set_num_threads(threads)
    records = []
    print(f"{args.rows} x {args.cols}, one bf16 token, {threads} threads; medians of {args.rounds} alternating rounds")
    print(f"{'method':12s} {'MB':>7s} {'ms':>7s} {'GEMV GB/s':>10s} {'read GB/s':>10s} {'%read':>6s}")
    for method in args.methods.split(","):
        r = measure(method, args.rows, args.cols, args.rounds)
        records.append(r)
        print(
            f"{method:12s} {r['mb']:7.1f} {r['ms']:7.2f} {r['gemv_gb_s']:10.1f} {r['read_gb_s']:10.1f} "
            f"{r['pct_read']:5.0f}%"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"rows": args.rows, "cols": args.cols, "threads": threads, "records": records}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
