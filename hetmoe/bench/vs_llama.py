"""One file's speeds in hetmoe with no flags, measured as llama.cpp's llama-bench measures its own.

hetmoe: ``load_model(FILE)`` with its defaults, as ``hetmoe generate FILE`` does; decode is the
faster of two runs of ``steps`` greedy one-token steps after a 1-token prompt (llama-bench's ``tg``
starts from an empty cache: the same contexts; it is the faster of llama-bench's two runs), prefill
a prompt into an empty cache with the logits of its last token only (llama-bench's ``pp`` computes
no others). Used by bench/bench_vs_llama.py and by
``hetmoe bench model --arch`` (arch_bench.py), which interleave it with llama_cpp.llama_bench per
file.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

# Decode runs per file, the faster kept: llama_cpp.llama_bench keeps the faster of its two runs (with
# and without repacking), so each program's figure is the better of two runs of `steps` tokens. On
# this project's VMs a run now and then holds a step or two of 30-40 ms where a Qwen3-shaped step
# takes ~7 ms (no page fault in them; cause not found), which alone cut a 32-token run from ~145 to
# ~114 tokens/s; `slowest_step_ms` shows it.
DECODE_RUNS = 2


def _decode_run(model: Any, first: Any, steps: int) -> tuple[float, float]:
    """``(tokens/s, slowest step s)`` of ``steps`` greedy one-token steps after the prompt ``first``."""
    from ..runtime.kv_cache import growing_cache

    cache = growing_cache(model.config)
    token = model(first, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
    slowest, t0 = 0.0, time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        slowest = max(slowest, time.perf_counter() - t)
    return steps / (time.perf_counter() - t0), slowest


def hetmoe_speeds(path: Path, threads: int, steps: int, prefill: tuple[int, ...]) -> dict[str, Any]:
    """``{"decode": tok/s, "prefill N": tok/s ..., "load_s": s, "notes": [...]}`` of ``load_model(path)``
    (with ``decode_runs`` and ``slowest_step_ms``: each decode run's tokens/s and slowest step)."""
    import torch

    from .. import load_model
    from ..gc_pause import freeze_for_decoding
    from ..runtime.kv_cache import growing_cache

    t0 = time.perf_counter()
    model = load_model(path, cpu_threads=threads)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0}
    freeze_for_decoding()  # as hetmoe generate does after its load; undone below
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    try:
        with torch.inference_mode():
            ids = torch.randint(0, min(vocab, 1000), (1, max(prefill)), generator=gen)
            model(ids[:, :8], cache=growing_cache(model.config), use_cache=True, logits_to_keep=1)  # warm-up
            for n in prefill:
                t0 = time.perf_counter()
                model(ids[:, :n], cache=growing_cache(model.config), use_cache=True, logits_to_keep=1)
                out[f"prefill {n}"] = n / (time.perf_counter() - t0)
            runs = [_decode_run(model, ids[:, :1], steps) for _ in range(DECODE_RUNS)]
            out["decode"] = max(rate for rate, _ in runs)
            out["decode_runs"] = [round(rate, 2) for rate, _ in runs]
            out["slowest_step_ms"] = [round(slowest * 1e3, 2) for _, slowest in runs]
        out["notes"] = list(model.hetmoe.notes)
    finally:
        del model
        gc.unfreeze()  # the next file's run starts from a collectable heap
        gc.collect()
    return out
