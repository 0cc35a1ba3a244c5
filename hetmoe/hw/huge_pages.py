"""Expert weights the process builds itself, on 2 MiB pages.

A decode step streams each active expert's bytes once, a few MiB per expert chosen at random from
hundreds of MB to hundreds of GB of weights. On 4 KiB pages every 4 KiB of those bytes needs its own
TLB entry and, where the page tables have left the caches, a page walk from DRAM; on 2 MiB pages one
walk covers 512 times as much. A model file read back from disk is mapped that way already: the page
cache holds it in large folios, which the kernel maps 2 MiB at a time (measured: 94% of a 1.4 GB
GGUF, `FilePmdMapped`; a file just written by `cp`, 0%). Weights the process makes (quantized or
re-quantized at load; a checkpoint directory's per-expert matrices stacked into one copy per
projection, gpt-oss's bf16 experts transposed; the benchmarks' and the tuner's random layers) land
on 4 KiB pages unless the kernel's transparent huge pages are `always`; most distributions ship
`madvise`, so they are asked for here: private anonymous memory, a 2 MiB-aligned start,
MADV_HUGEPAGE before any page is touched. Measured on a Zen 4 (2 threads), a 16-layer
Qwen3-30B-A3B-shaped model from a Q4_0 GGUF re-quantized to int4 at load decodes 47.8 tokens/s on
huge pages against 45.4 on 4 KiB pages (the file itself: 44.3 mapped 2 MiB at a time against 42.1
for a fresh copy of it); from bf16 directories, stacked on huge pages against 4 KiB pages, a 4-layer
Qwen3-30B-A3B-shaped model 51.9-53.5 against 49.8-52.2 tokens/s and a 2-layer Mixtral-8x7B-shaped
one 15.2-15.8 against 14.6-14.9. The price on that VM is at load: memory the guest has not touched
lately costs ~0.6 s a GB more as 2 MiB pages (the 4-layer model's load 3.2 -> 6.5 s), where 4 KiB
pages come from the recently freed; pages freed and reused cost less than 4 KiB ones (0.09 against
0.23 s a GiB).

Where the kernel cannot (no THP, not Linux, `never`), or `HETMOE_HUGE_PAGES=0`, or the tensor is
smaller than a huge page, this is plain `torch.empty`: the same bytes on small pages.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os

import torch

HUGE_PAGE_BYTES = 2 << 20  # x86-64's PMD size; what /sys/kernel/mm/transparent_hugepage/hpage_pmd_size says


def huge_pages_wanted() -> bool:
    """Whether to ask for huge pages: Linux's MADV_HUGEPAGE exists and HETMOE_HUGE_PAGES is not 0."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("HETMOE_HUGE_PAGES", "1") != "0"


def empty(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor whose storage starts on a 2 MiB boundary of memory the
    kernel was asked to back with transparent huge pages (the tail past the last whole huge page
    too, on small pages). It frees its mapping when the last view of it goes."""
    shape = tuple(int(d) for d in shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE_BYTES or not huge_pages_wanted():
        return torch.empty(shape, dtype=dtype)
    try:
        # private anonymous: a shared mapping (mmap's default) is shmem, which THP treats apart
        region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` (its buffer) alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    with contextlib.suppress(OSError):  # a kernel without THP: the mapping still works, on small pages
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return raw[start : start + nbytes].view(dtype).view(shape)


def copy_to_huge_pages(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` (a CPU tensor, any strides) as a contiguous tensor of ``dtype`` (``t``'s by default) in
    :func:`empty`'s memory; a plain contiguous tensor (``t`` itself where it is one) where it is
    smaller than a huge page or huge pages are not wanted."""
    dtype = dtype or t.dtype
    if t.numel() * dtype.itemsize < HUGE_PAGE_BYTES or not huge_pages_wanted():
        return t.to(dtype).contiguous()
    out = empty(t.shape, dtype)
    out.copy_(t)
    return out
