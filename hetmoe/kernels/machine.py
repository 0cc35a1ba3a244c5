"""Measured limits of this machine: sustained read bandwidth and fp32 FMA peak, cached.

Both are measured by the compiled engine (csrc/measure.cpp) in a few seconds and cached per
(CPU model, thread count, kernel variant) under ``$XDG_CACHE_HOME/hetmoe`` so ``doctor`` and
``bench`` agree and do not re-measure on every run. They are the roofline every benchmark
reports against.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..hw import cpu_info, huge_pages
from .dispatch import engine_module

BANDWIDTH_BUFFER_BYTES = 1 << 30  # larger than any last-level cache this is likely to meet
# Passes over it, the best kept: ~1 s at 60 GB/s. On a shared machine the bandwidth a process gets
# moves by tens of percent within seconds (a VM's neighbours); a handful of passes could all land in
# a busy moment and understate what the memory system does (three runs a minute apart on a Zen 5
# VM: 5 passes 43, 54 and 49 GB/s, then 40 passes 42, 57 and 59).
BANDWIDTH_PASSES = 40
# Part of the cache key: a figure measured the way an older version did is measured again. 2: the
# read streams memory on 2 MiB pages, as the weights are (hw/huge_pages.py).
MEASURE_VERSION = 2


def cache_path() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "hetmoe" / "machine.json"


SAMPLE_BYTES = 256 << 20  # what read_bandwidth_now streams: 8x a 32 MiB last-level cache
PLAIN_READ_CHUNK = 1 << 20  # the engine's work items cover up to ~1 MiB of weights
_buffer: torch.Tensor | None = None  # 1 GiB kept for the process: no page faults per sample


def _sample_buffer() -> torch.Tensor:
    global _buffer
    if _buffer is None:
        # on huge pages, as the weights it stands beside are (huge_pages.py)
        _buffer = huge_pages.empty((BANDWIDTH_BUFFER_BYTES // 8,), torch.int64).fill_(1)
    return _buffer


def read_bandwidth_now(threads: int | None = None) -> float:
    """Read bandwidth (GB/s) measured now, uncached: best of 3 passes over 256 MiB, ~30 ms.

    Benchmarks sample it beside each measurement: on a shared machine (a VM whose neighbours come
    and go) the bandwidth moves by tens of percent within seconds, so a fraction of the cached
    figure says as much about the neighbours as about the kernel."""
    threads = threads or max(1, cpu_info().usable_cpus)
    buf = _sample_buffer()
    return round(engine_module().measure_read_bandwidth_of(buf.data_ptr(), SAMPLE_BYTES, threads, 3), 2)


def plain_read_gb_per_s(total_bytes: int, reps: int = 20, seed: int = 0) -> float:
    """Median GB/s of reading ``total_bytes`` in random 1 MiB chunks of a 1 GiB buffer (they miss a
    32 MiB cache ~97% of the time) on the engine's pool, with its prefetching and no arithmetic: the
    ceiling of a decode step that streams that many bytes of experts (unlike the doctor's long
    sequential streams, every chunk starts a stream cold, as every expert does)."""
    total = max(PLAIN_READ_CHUNK, int(total_bytes) // PLAIN_READ_CHUNK * PLAIN_READ_CHUNK)
    buf = _sample_buffer()
    gbps = engine_module().measure_chunked_read(
        buf.data_ptr(), BANDWIDTH_BUFFER_BYTES, PLAIN_READ_CHUNK, total, reps, seed
    )
    return round(gbps, 2)


def measure_machine(threads: int | None = None, refresh: bool = False) -> dict[str, Any]:
    """``{"read_gb_per_s", "fma_gflop_per_s", "threads", "isa", "cpu", "measured_at"}``."""
    mod = engine_module()
    info = cpu_info()
    threads = threads or max(1, info.usable_cpus)
    key = f"{info.model}|{threads}|{mod.selected_isa()}|{MEASURE_VERSION}"
    path = cache_path()
    cache: dict[str, Any] = {}
    if path.exists():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}
    if not refresh and key in cache:
        return cache[key]
    # On 2 MiB pages, where the weights are: on 4 KiB pages the read measures the page walks as much
    # as the memory (2 vCPUs of an Intel Xeon VM with AMX: 20.9 GB/s against 33-37). Untouched, so
    # each reading thread first touches its own slice (NUMA placement).
    buf = huge_pages.empty((BANDWIDTH_BUFFER_BYTES // 8,), torch.int64)
    read = mod.measure_read_bandwidth(buf.data_ptr(), BANDWIDTH_BUFFER_BYTES, threads, BANDWIDTH_PASSES)
    del buf
    record = {
        "read_gb_per_s": round(read, 2),
        "fma_gflop_per_s": round(mod.measure_fma_peak(threads, 0.5), 1),
        "threads": threads,
        "isa": mod.selected_isa(),
        "cpu": info.model,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    cache[key] = record
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    except OSError:  # a read-only home is no reason to fail a measurement
        pass
    return record
