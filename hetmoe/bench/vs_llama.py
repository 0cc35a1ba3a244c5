"""One file's speeds in hetmoe with no flags, measured as llama.cpp's llama-bench measures its own.

hetmoe: ``load_model(FILE)`` with its defaults, as ``hetmoe generate FILE`` does; decode is
``steps`` greedy one-token steps after a 1-token prompt (llama-bench's ``tg`` starts from an empty
cache: the same contexts), prefill a prompt into an empty cache with the logits of its last token
only (llama-bench's ``pp`` computes no others). Used by bench/bench_vs_llama.py and by
``hetmoe bench model --arch`` (arch_bench.py), which interleave it with llama_cpp.llama_bench per
file.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any


def hetmoe_speeds(path: Path, threads: int, steps: int, prefill: tuple[int, ...]) -> dict[str, Any]:
    """``{"decode": tok/s, "prefill N": tok/s ..., "load_s": s, "notes": [...]}`` of ``load_model(path)``."""
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
            cache = growing_cache(model.config)
            token = model(ids[:, :1], cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(steps):
                token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
            out["decode"] = steps / (time.perf_counter() - t0)
        out["notes"] = list(model.hetmoe.notes)
    finally:
        del model
        gc.unfreeze()  # the next file's run starts from a collectable heap
        gc.collect()
    return out
