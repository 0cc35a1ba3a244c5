#!/usr/bin/env python3
"""The one-call decode step (hetmoe/models/fast_decode.py) against transformers' own layer forward,
per architecture, on random models with a real model's attention, in one run, alternating.

    python bench/bench_fast_decode.py --family glm4_moe --family minimax_m2 --rounds 3

Each family's model has the attention and hidden size of the model hetmoe/bench/arch_models.py
names (heads, KV heads, head_dim, the rotary part, biases, q/k norms) and 4 layers, but 16 experts
a layer and a 32,000-token vocabulary: the attention half and the glue between modules, which is
what the one-call step changes, stay as in the real model, while the expert and lm_head bytes a
step reads are smaller. Models are built once (random bf16, transformers' ``save_pretrained``) under --cache.

Per round and family: decode tokens/s of --steps greedy one-token steps after a 32-token prompt,
``load_model(DIR)`` with its defaults, once as loaded ("one call") and once with the decoder
layers' and the causal LM's forwards set back to transformers' ("transformers' layers"); for a
family whose class has no SDPA (gpt-oss), a third time on transformers' eager attention as well,
the way it ran before the engine's kernels took its sinks. Prints each round, then the medians and
the time a step saves per layer. Nothing printed is stored. gpt-oss alternates sliding-window
(128) and full layers: ``--prompt 160`` decodes past the window.
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

from hetmoe.bench.arch_models import ARCHS, ArchModel

FAMILIES = ("qwen3_moe", "glm4_moe", "minimax_m2", "deepseek_v3", "gpt_oss")
EXPERTS = 16  # a layer's routed experts here (the released models have 32 to 256)
DEFAULT_CACHE = Path.home() / ".cache" / "hetmoe" / "bench-fast-decode"


def build(family: str, cache: Path) -> Path:
    """The family's random model directory, written once (atomically) under ``cache``."""
    from transformers import AutoModelForCausalLM

    from hetmoe.checkpoint.atomic import atomic_dir

    out = cache / family
    if (out / "config.json").is_file():
        return out
    config = ArchModel(family, layers=4, vocab=32000, experts=EXPERTS).config()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
    print(f"built {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def decode_speed(model: Any, steps: int, prompt: int) -> float:
    from hetmoe.runtime.kv_cache import growing_cache

    ids = torch.randint(0, 1000, (1, prompt), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = growing_cache(model.config)
        token = model(ids, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        return steps / (time.perf_counter() - t0)


def transformers_layers(model: Any) -> dict[int, Any]:
    """Take the one-call forwards off, the decoder layers' and the causal LM's (returned, to put
    back); what else load_model installed (the fused norms, MLA's absorbed attention) stays."""
    taken = {}
    for m in model.modules():  # the model itself first
        forward = vars(m).get("forward")
        if forward is not None and (m is model or getattr(forward, "hetmoe_fast_decode", False)):
            taken[id(m)] = (m, vars(m).pop("forward"))
    return taken


def eager_attention(model: Any) -> str | None:
    """Put a model that hetmoe switched from transformers' eager attention (a class without SDPA:
    gpt-oss) back on it, as it ran before the engine's kernels took its sinks; returns the name to
    restore, or None for the other families."""
    if getattr(model, "_supports_sdpa", True):
        return None
    name = model.config._attn_implementation
    model.set_attn_implementation("eager")
    return name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", action="append", choices=FAMILIES, help="repeat; default: all")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens before the steps (default 32)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help=f"model directory (default {DEFAULT_CACHE})")
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args()
    from hetmoe import load_model

    families = args.family or list(FAMILIES)
    models = {f: load_model(build(f, args.cache), cpu_threads=args.threads) for f in families}
    for f, model in models.items():
        fast = sum(getattr(vars(m).get("forward"), "hetmoe_fast_decode", False) for m in model.modules())
        print(f"{f} ({ARCHS[f].model} attention): {fast} of {model.config.num_hidden_layers} layers take one call")
    records: dict[str, dict[str, list[float]]] = {f: {"one call": [], "transformers": []} for f in families}
    print(f"{'family':12s} {'round':>5s} {'one call t/s':>13s} {'transformers t/s':>17s} {'x':>6s}  eager t/s")
    for r in range(args.rounds):
        for f, model in models.items():
            one = decode_speed(model, args.steps, args.prompt)
            taken = transformers_layers(model)
            try:
                plain = decode_speed(model, args.steps, args.prompt)
                ours = eager_attention(model)  # and transformers' own attention, where it was eager
                if ours is not None:
                    records[f].setdefault("eager", []).append(decode_speed(model, args.steps, args.prompt))
                    model.set_attn_implementation(ours)
            finally:
                for m, forward in taken.values():
                    m.forward = forward
            records[f]["one call"].append(one)
            records[f]["transformers"].append(plain)
            eager = f"{records[f]['eager'][-1]:10.1f}" if "eager" in records[f] else ""
            print(f"{f:12s} {r:5d} {one:13.1f} {plain:17.1f} {one / plain:6.2f}{eager}", flush=True)
    print("medians:")
    for f in families:
        one, plain = (statistics.median(records[f][k]) for k in ("one call", "transformers"))
        saved = (1 / plain - 1 / one) * 1e3 / models[f].config.num_hidden_layers
        line = f"  {f}: {one:.1f} vs {plain:.1f} tokens/s = {one / plain:.2f}x, {saved:.2f} ms a layer saved a step"
        if "eager" in records[f]:
            eager = statistics.median(records[f]["eager"])
            line += f"; against transformers' eager attention {eager:.1f} tokens/s = {one / eager:.2f}x"
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "records": records}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
