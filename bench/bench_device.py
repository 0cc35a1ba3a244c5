#!/usr/bin/env python3
"""The device paths on the 4-layer Qwen3-30B-A3B-shaped model: decode and prefill tokens/s with the
non-expert layers on --device and the routed experts

- all in the CPU engine ("cpu experts"),
- --gpu-experts of them a layer also resident on the device ("device experts"),
- streamed to the device layer by layer for prompts above --prefill-threshold ("layerwise prefill").

scripts/gpu_check.sh runs it on a machine with a GPU. With --device cpu it runs anywhere, the CPU
standing in for the device as the tests do (the figures then say nothing about a GPU).

    python bench/bench_device.py --device cuda --json gpu-device.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hetmoe import load_model
from hetmoe.bench.model import expert_source
from hetmoe.bench.model_build import DEFAULT_CACHE, ModelShape, build_model
from hetmoe.runtime.kv_cache import growing_cache


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _decode_tokens_per_s(model: Any, vocab: int, context: int, steps: int, device: str) -> float:
    gen = torch.Generator().manual_seed(0)
    cache = growing_cache(model.config)
    out = model(torch.randint(0, vocab, (1, context), generator=gen).to(device), cache=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(times)


def _prefill_tokens_per_s(model: Any, vocab: int, tokens: int, repeats: int, device: str) -> float:
    gen = torch.Generator().manual_seed(1)
    times = []
    for _ in range(repeats):
        ids = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)
        _sync(device)
        t0 = time.perf_counter()
        model(ids, cache=growing_cache(model.config), use_cache=True, logits_to_keep=1)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return tokens / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="where the non-expert layers run (default cuda)")
    p.add_argument("--method", default="int4", help="the CPU experts' method (default int4)")
    p.add_argument("--gpu-experts", type=int, default=16, help="experts a layer on the device (default 16 of 128)")
    p.add_argument("--prefill-threshold", type=int, default=64, help="layerwise above this many tokens (64)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before decoding (128)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed (16)")
    p.add_argument("--prefill", type=int, default=512, help="prefill tokens (512)")
    p.add_argument("--repeats", type=int, default=3, help="prefill repeats (3)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (4)")
    p.add_argument("--threads", type=int, help="CPU engine threads (default: all usable CPUs)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"where models are built ({DEFAULT_CACHE})")
    p.add_argument("--json", metavar="FILE", help="write the records as JSON")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"bench_device: --device {args.device} but torch sees no CUDA device", file=sys.stderr)
        return 1
    shape = ModelShape(layers=args.layers)
    base = build_model(shape, args.cache_dir, log=print)
    path, convert_to = expert_source(base, args.method, args.cache_dir, print)
    variants = {
        "cpu experts": {},
        "device experts": {"gpu_experts": args.gpu_experts},
        "layerwise prefill": {"prefill_threshold": args.prefill_threshold},
    }
    records = []
    for name, extra in variants.items():
        t0 = time.perf_counter()
        model = load_model(path, convert_to, args.device, cpu_threads=args.threads, **extra)
        load_s = time.perf_counter() - t0
        with torch.inference_mode():
            decode = _decode_tokens_per_s(model, shape.vocab, args.context, args.steps, args.device)
            prefill = _prefill_tokens_per_s(model, shape.vocab, args.prefill, args.repeats, args.device)
        record = {
            "variant": name,
            **extra,
            "load_s": round(load_s, 2),
            "decode_tokens_per_s": round(decode, 2),
            f"prefill{args.prefill}_tokens_per_s": round(prefill, 1),
        }
        print(
            f"{name:18s} load {load_s:6.1f} s  decode {decode:7.2f} tokens/s  "
            f"prefill {args.prefill} {prefill:8.1f} tokens/s  {extra or ''}"
        )
        records.append(record)
        del model
    if args.json:
        meta = {
            "device": args.device,
            "method": args.method,
            "model": shape.name,
            "context": args.context,
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None,
        }
        Path(args.json).write_text(json.dumps({**meta, "records": records}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
