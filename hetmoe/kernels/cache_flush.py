"""Evicting the CPU caches between timed runs, so a benchmark times DRAM and not the cache.

This project's VMs report L3s of up to 300 MiB: a whole int4 MoE layer of Qwen3-30B-A3B (340 MB) nearly fits,
so timing one layer's decode step over and over would read most experts from the cache. Inside a
real model the other layers' weights pass through the cache between two calls of a layer.
"""

from __future__ import annotations

import numpy as np


def last_level_cache_bytes() -> int:
    """The largest cache this CPU reports (sysfs), 32 MiB when unknown."""
    from ..hw import cpu_info

    sizes = [_cache_size(v) for v in cpu_info().caches.values()]
    return max([s for s in sizes if s] or [32 * 2**20])


def _cache_size(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper()
    try:
        return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)
    except ValueError:
        return 0


class CacheFlush:
    """Evicts the caches by reading a buffer twice their size: a part timed alone then reads its
    weights from DRAM, as it does inside a decode step, where the rest of the model's weights went
    through the cache since its last call (reused weights would otherwise time the cache, not the part)."""

    def __init__(self, nbytes: int) -> None:
        # numpy, not torch: a torch op would wake torch's OpenMP workers, which then spin into the
        # timed region and take a core from the engine (prefill 512 measured 1.5x slower that way)
        self.buffer = np.ones(max(0, nbytes) // 8, dtype=np.int64)

    def __call__(self) -> None:
        if self.buffer.size:
            self.buffer.sum()
