"""``hetmoe bench model``: a whole model on the CPU, decode and prefill tokens/s, and where the time goes.

The model is a random Qwen3-MoE of Qwen3-30B-A3B's layer shape with any number of layers, written
once as ``source``: a bf16 safetensors directory (model_build.py), or straight into a 4-bit file
that a user would download, a pure-Q4_0 GGUF or a compressed-tensors int4 g32 directory
(model_write.py; a full-depth model never exists in bf16). It is loaded CPU-only with ``load_model``:
routed experts in one engine method (int4 g32, bf16, GGUF Q4_0 ..., or ``stored``: as the file
holds them) and the dense layers (attention projections, lm_head) in the engine too
(``dense_method``), as torch bf16 Linears (``torch``) or as ``load_model`` does with no flags
(``default``). A variant is written ``EXPERTS/DENSE``, e.g. ``int4/int8``, ``bf16/bf16``,
``gguf:q4_0/gguf:q4_0``, ``int4/torch``, ``stored/default``.

The load itself is measured too: its seconds, the process's peak resident memory during it (the
kernel's high-water mark, reset before the load), the bytes of the model's files and the seconds of
a plain sequential read of them just before (with ``cold``, the page cache is dropped before each).

Per variant and torch thread count it measures, with medians over repeats:

- decode: a prompt of ``context`` tokens, then ``steps`` single-token forwards with the KV cache;
  tokens/s from the median step;
- prefill: forwards of 128 and 512 tokens into an empty cache (the logits of the last token only,
  as ``generate`` asks for); tokens/s;
- the split of that time over the model's parts, from forward hooks in a separate pass (the
  headline numbers come from passes without hooks): attention linears (q/k/v/o, torch or engine),
  attention core (everything else in attention: norms of q/k, RoPE, the attention itself, the
  cache), router and glue of the MoE blocks, CPU experts (submit to result), lm_head, and other
  (embeddings, norms, residuals, Python);
- the sum of parts measured separately: each part run alone on inputs of the same shape (the
  attention linears, the model's attention function over the same context, the router, every
  layer's CPU experts on routed tokens, the lm_head), summed over the layers, with the caches
  flushed before each timing (a buffer of twice the last-level cache is read) so that each part
  reads its weights from DRAM as it does inside a decode step. A decode step within 1.3x of that
  sum means little is lost between the parts.

Thread policy: the engine's pool has ``threads`` workers (default: every usable core); torch's
intra-op threads are set per run (``torch_threads``), since both compete for the same cores.
llama.cpp is measured, not quoted: with ``llama_bench``, llama-bench runs after hetmoe's variants in
the same run (bench/llama_cpp.py) on ``llama_gguf`` (GGUF files of the same model, made with
llama.cpp's converter and quantizer), else on the Q4_0 GGUF source itself; without it no llama.cpp
figures are printed.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.atomic import write_text_atomic
from ..gc_pause import freeze_for_decoding
from ..hw import cpu_info
from ..kernels import select_isa, set_num_threads
from ..kernels.cache_flush import CacheFlush, last_level_cache_bytes
from ..runtime.cpu_linear import CPULinear
from ..runtime.hybrid import HybridMoE
from .llama_cpp import llama_bench
from .model_build import DEFAULT_CACHE, ModelShape
from .model_write import build_source

DEFAULT_VARIANTS = ("int4/int8", "int4/int4", "int4/torch", "bf16/bf16", "gguf:q4_0/gguf:q4_0")
PARTS = ("attn_linears", "attn_core", "router_glue", "cpu_experts", "lm_head", "other")
OVERHEAD_TARGET = 1.3


@dataclass
class ModelBenchConfig:
    shape: ModelShape = field(default_factory=ModelShape)
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    threads: int = 0  # engine workers (0: every usable core)
    torch_threads: tuple[int, ...] = (1,)
    context: int = 128  # prompt tokens before the decode steps
    steps: int = 32  # decode steps per repeat
    prefill: tuple[int, ...] = (128, 512)
    repeats: int = 3
    cache_dir: Path = DEFAULT_CACHE
    seed: int = 0
    isa: str = "auto"
    flush_bytes: int | None = None  # read between timings of a part alone (None: twice the last-level cache)
    llama_bench: Path | None = None  # llama.cpp's llama-bench, run on llama_gguf in this run
    llama_gguf: tuple[Path, ...] = ()  # GGUF files of this model (llama.cpp's converter and quantizer)
    source: str = "bf16"  # how the model is written: model_write.SOURCES
    cold: bool = False  # drop the page cache before the plain read and before the load (needs root)


def parse_variant(text: str) -> tuple[str, str]:
    """``"int4/int8"`` -> (experts method or "stored", dense method, "torch" or "default")."""
    experts, sep, dense = text.partition("/")
    if not sep or not experts or not dense:
        raise ValueError(f"variant {text!r}: expected EXPERTS/DENSE, e.g. int4/int8, int4/torch or stored/default")
    return experts, dense  # "torch" keeps them in torch (load_model's opt-out)


def expert_source(
    base: Path, method: str, cache_dir: Path, log: Callable[[str], None], source: str = "bf16"
) -> tuple[Path, str | None]:
    """Where to load ``method``'s experts from, and the method to convert to while loading.

    ``stored`` (and bf16 from the bf16 model) loads the experts as the file holds them. From the
    bf16 model, store methods are converted once into a cached expert store (loads are then quick)
    and GGUF types, which a store does not hold, by load_model on each load; from a 4-bit source,
    every other method is converted by load_model on each load.
    """
    if method == "stored" or (method == "bf16" and source == "bf16"):
        return base, None
    if source != "bf16":
        return base, method
    if method.startswith("gguf:"):
        return base, method
    from ..checkpoint.convert import convert
    from ..checkpoint.store import MANIFEST

    dst = Path(cache_dir) / f"{base.name}-{method.replace(':', '_')}"
    if not (dst / MANIFEST).exists():
        log(f"converting the experts to {method} into {dst} (once)")
        convert(base, dst, method, resume=dst.exists(), progress=False, log=log)
    return dst, None


def _release() -> None:
    gc.collect()
    from ..models.loader import release_freed_memory

    release_freed_memory()


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


# --- timing the whole model ---------------------------------------------------------------------


def _prompt(shape: ModelShape, tokens: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, shape.vocab, (1, tokens), generator=gen)


def _decode_start(model: nn.Module, shape: ModelShape, context: int, gen: torch.Generator) -> tuple[Any, torch.Tensor]:
    """A KV cache holding a prompt of ``context`` tokens, and the next token."""
    from ..runtime.kv_cache import growing_cache

    cache = growing_cache(model.config)
    out = model(_prompt(shape, context, gen), cache=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1:].argmax(-1)


def decode_steps(model: nn.Module, cache: Any, token: torch.Tensor, steps: int) -> list[float]:
    """Seconds of each of ``steps`` single-token forwards (greedy) continuing ``cache``."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = model(token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
    return times


def _prefill(model: nn.Module, shape: ModelShape, tokens: int, gen: torch.Generator) -> float:
    from ..runtime.kv_cache import growing_cache

    ids = _prompt(shape, tokens, gen)
    t0 = time.perf_counter()
    model(ids, cache=growing_cache(model.config), use_cache=True, logits_to_keep=1)
    return time.perf_counter() - t0


class _Split:
    """Forward hooks that add up the time spent in attention, its linears, the MoE blocks, the lm_head."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.totals = dict.fromkeys(("attention", "attn_linears", "moe", "lm_head"), 0.0)
        self._start: dict[int, float] = {}
        self._handles = []
        for name, mod in model.named_modules():
            if name.endswith("self_attn"):
                self._watch(mod, "attention")
                for sub in mod.modules():
                    if isinstance(sub, nn.Linear | CPULinear):
                        self._watch(sub, "attn_linears")
            elif isinstance(mod, HybridMoE):
                self._watch(mod, "moe")
        self._watch(model.get_output_embeddings(), "lm_head")

    def _watch(self, mod: nn.Module, key: str) -> None:
        def pre(m: nn.Module, args: Any) -> None:
            self._start[id(m)] = time.perf_counter()

        def post(m: nn.Module, args: Any, out: Any) -> None:
            self.totals[key] += time.perf_counter() - self._start.pop(id(m))

        self._handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def _split_of(model: nn.Module, run: Callable[[], float]) -> dict[str, float]:
    """Milliseconds per part of one call of ``run`` (which returns its wall seconds)."""
    runtime = model.hetmoe
    split = _Split(model)
    runtime.reset_timing()
    try:
        total = run()
    finally:
        split.close()
    t = split.totals
    cpu = runtime.timing.cpu_s
    parts = {
        "attn_linears": t["attn_linears"],
        "attn_core": t["attention"] - t["attn_linears"],
        "router_glue": t["moe"] - cpu,
        "cpu_experts": cpu,
        "lm_head": t["lm_head"],
    }
    parts["other"] = total - t["attention"] - t["moe"] - t["lm_head"]
    out = {k: round(v * 1e3, 3) for k, v in parts.items()}
    out["total"] = round(total * 1e3, 3)
    return out


# --- the parts alone ----------------------------------------------------------------------------


def _time_alone(fn: Callable[[], Any], repeats: int, flush: CacheFlush) -> float:
    fn()  # warm-up
    times = []
    for _ in range(max(3, repeats)):
        flush()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _median_ms(times)


def _attention_alone(model: nn.Module, q: torch.Tensor, kv: torch.Tensor) -> Callable[[], Any]:
    """The model's own attention function (hetmoe's CPU attention on a CPU-only load) on q over kv."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    attn = model.model.layers[0].self_attn
    if name in ALL_ATTENTION_FUNCTIONS:
        fn = ALL_ATTENTION_FUNCTIONS[name]
        return lambda: fn(attn, q, kv, kv, None, scaling=attn.scaling)
    causal = q.shape[2] > 1
    return lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=causal, enable_gqa=True)


def _parts_alone(
    model: nn.Module, shape: ModelShape, tokens: int, context: int, repeats: int, flush: CacheFlush
) -> dict[str, float]:
    """Milliseconds of each part run on its own for ``tokens`` new tokens over ``context`` cached ones,
    summed over the layers (the lm_head once, for the last token)."""
    gen = torch.Generator().manual_seed(tokens)
    dtype = torch.bfloat16
    layers = model.model.layers
    out = dict.fromkeys(("attn_linears", "attn_core", "router_glue", "cpu_experts", "lm_head"), 0.0)
    for layer in layers:
        attn = layer.self_attn
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            x = torch.randn(1, tokens, proj.in_features, generator=gen).to(dtype)
            out["attn_linears"] += _time_alone(lambda proj=proj, x=x: proj(x), repeats, flush)
        moe = layer.mlp

        def routed(moe: HybridMoE = moe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            x = (torch.randn(tokens, shape.hidden, generator=gen) * 0.5).to(dtype)
            w, ids = moe.adapter.route(moe, x)
            return x, ids.to(torch.int64).contiguous(), w.float().contiguous()

        x, _, _ = routed()
        out["router_glue"] += _time_alone(lambda moe=moe, x=x: moe.adapter.route(moe, x), repeats, flush)
        # A fresh routing every repetition: decode reads each layer's experts from DRAM, not cache.
        draws = [routed() for _ in range(max(3, repeats) + 1)]
        out["cpu_experts"] += _time_alone(lambda moe=moe, d=draws: moe.cpu.forward(*d.pop()), repeats, flush)
    q = torch.randn(1, shape.heads, tokens, shape.head_dim, generator=gen).to(dtype)
    kv = torch.randn(1, shape.kv_heads, context + tokens, shape.head_dim, generator=gen).to(dtype)
    out["attn_core"] = len(layers) * _time_alone(_attention_alone(model, q, kv), repeats, flush)
    head = model.get_output_embeddings()
    x = torch.randn(1, 1, shape.hidden, generator=gen).to(dtype)
    out["lm_head"] = _time_alone(lambda: head(x), repeats, flush)
    rounded = {k: round(v, 3) for k, v in out.items()}
    rounded["sum"] = round(sum(out.values()), 3)
    return rounded


# --- one variant --------------------------------------------------------------------------------


def _measure(model: nn.Module, cfg: ModelBenchConfig) -> dict[str, Any]:
    shape = cfg.shape
    gen = torch.Generator().manual_seed(cfg.seed)
    decode_steps(model, *_decode_start(model, shape, 8, gen), 2)  # warm-up: pool, buffers, first pages
    steps: list[float] = []
    for _ in range(cfg.repeats):
        steps += decode_steps(model, *_decode_start(model, shape, cfg.context, gen), cfg.steps)
    decode_ms = _median_ms(steps)
    prefill = {}
    for tokens in cfg.prefill:
        _prefill(model, shape, tokens, gen)  # warm-up: first touch of buffers of this size
        prefill[tokens] = _median_ms([_prefill(model, shape, tokens, gen) for _ in range(cfg.repeats)])
    # The split comes from passes of its own: hooks cost a little, the headline numbers carry none.
    cache, token = _decode_start(model, shape, cfg.context, gen)
    split = _split_of(model, lambda: sum(decode_steps(model, cache, token, cfg.steps)))
    flush = CacheFlush(cfg.flush_bytes if cfg.flush_bytes is not None else 2 * last_level_cache_bytes())
    alone = _parts_alone(model, shape, 1, cfg.context, cfg.repeats, flush)
    out: dict[str, Any] = {
        "decode": {
            "context": cfg.context,
            "ms_per_token": round(decode_ms, 3),
            "tokens_per_s": round(1e3 / decode_ms, 2),
            "ms_min": round(min(steps) * 1e3, 3),
            "ms_max": round(max(steps) * 1e3, 3),
            "split_ms": {k: round(v / cfg.steps, 3) for k, v in split.items()},  # per token
            "parts_alone_ms": alone,
            "vs_parts": round(decode_ms / alone["sum"], 3),
        },
        "prefill": {},
    }
    for tokens in cfg.prefill:
        pf_split = _split_of(model, lambda tokens=tokens: _prefill(model, shape, tokens, gen))
        pf_alone = _parts_alone(model, shape, tokens, 0, cfg.repeats, flush)
        out["prefill"][str(tokens)] = {
            "ms": round(prefill[tokens], 2),
            "tokens_per_s": round(tokens * 1e3 / prefill[tokens], 1),
            "split_ms": pf_split,
            "parts_alone_ms": pf_alone,
            "vs_parts": round(prefill[tokens] / pf_alone["sum"], 3),
        }
    return out


def measure_variant(
    source: tuple[Path, str | None], variant: str, torch_threads: int, cfg: ModelBenchConfig, log: Callable[[str], None]
) -> dict[str, Any]:
    """Load ``source`` (path, method to convert to) as ``variant`` with torch at ``torch_threads``, measure it."""
    from ..models.loader import load_model

    experts, dense = parse_variant(variant)
    previous = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        path, method = source
        files = model_files(path)
        read_s = plain_read(files, cfg.cold)
        if cfg.cold:
            drop_page_cache()
        before = memory_status()["VmRSS"]
        reset_peak_rss()
        t0 = time.perf_counter()
        dense_method = None if dense == "default" else dense
        model = load_model(path, method, "cpu", cpu_threads=cfg.threads or None, dense_method=dense_method)
        load_s = time.perf_counter() - t0
        freeze_for_decoding()  # as hetmoe generate does after its load; undone in finally
        rss = memory_status()
        stored = sum(f.stat().st_size for f in files)
        load = {
            "s": round(load_s, 2),
            "cold": cfg.cold,
            "stored_gb": round(stored / 1e9, 3),
            "plain_read_s": round(read_s, 3),
            "vs_plain_read": round(load_s / read_s, 2),
            "rss_before_gb": round(before / 1e9, 3),
            "peak_rss_gb": round(rss["VmHWM"] / 1e9, 3),
            "rss_after_gb": round(rss["VmRSS"] / 1e9, 3),
            "peak_over_stored_gb": round((rss["VmHWM"] - stored) / 1e9, 3),
        }
        with torch.inference_mode():
            measured = _measure(model, cfg)
        record = {
            "variant": variant,
            "experts": experts,
            "dense": {"torch": "torch bf16", "default": "load_model's default"}.get(dense, dense),
            "torch_threads": torch_threads,
            "load_s": round(load_s, 2),
            "load": load,
            "expert_bytes": model.hetmoe.cpu_expert_bytes,
            "dense_engine_bytes": sum(m.nbytes for m in model.modules() if isinstance(m, CPULinear)),
            **measured,
            "notes": list(model.hetmoe.notes),
        }
        del model
        log(format_record(record))
        return record
    finally:
        gc.unfreeze()  # the dropped model's cycles collectable again
        torch.set_num_threads(previous)
        _release()


def run_bench(cfg: ModelBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    variants = [parse_variant(v) for v in cfg.variants]  # bad spellings fail before any building
    if any(t < 1 for t in cfg.torch_threads):
        raise ValueError(f"torch threads must be >= 1, got {list(cfg.torch_threads)}")
    isa = select_isa(cfg.isa)
    if cfg.threads:
        set_num_threads(cfg.threads)
    engine_threads = cfg.threads or len(os.sched_getaffinity(0))  # the pool's default: every usable core
    cpu_model = cpu_info().model
    if cfg.llama_gguf and cfg.llama_bench is None:
        raise ValueError("--llama-gguf needs --llama-bench (the llama-bench binary to run on them)")
    if cfg.llama_bench and not cfg.llama_gguf and cfg.source != "q4_0-gguf":
        raise ValueError(f"--llama-bench on a {cfg.source} source needs --llama-gguf (GGUF files of the model)")
    base = build_source(cfg.shape, cfg.source, cfg.cache_dir, cfg.seed, log)
    experts = dict.fromkeys(e for e, _ in variants)
    sources = {m: expert_source(base, m, cfg.cache_dir, log, cfg.source) for m in experts}
    records = []
    for variant, (experts, _) in zip(cfg.variants, variants, strict=True):
        for threads in cfg.torch_threads:
            records.append(measure_variant(sources[experts], variant, threads, cfg, log))
    llama = {}
    ggufs = cfg.llama_gguf or ((base,) if cfg.llama_bench and cfg.source == "q4_0-gguf" else ())
    for gguf in ggufs:  # after hetmoe's variants, in the same run
        log(f"llama-bench on {gguf}")
        llama[Path(gguf).name] = llama_bench(cfg.llama_bench, gguf, engine_threads, cfg.steps, tuple(cfg.prefill))
    return {
        "model": base.name,
        "source": cfg.source,
        "model_path": str(base),
        "shape": asdict(cfg.shape),
        "isa": isa,
        "engine_threads": engine_threads,
        "context": cfg.context,
        "steps": cfg.steps,
        "repeats": cfg.repeats,
        "flush_bytes": cfg.flush_bytes if cfg.flush_bytes is not None else 2 * last_level_cache_bytes(),
        "cpu": cpu_model,
        "llama_cpp": llama,
        "records": records,
    }


# --- the load: files, a plain read, memory -----------------------------------------------------


def model_files(path: Path) -> list[Path]:
    """The files a load of ``path`` reads: the file itself, or a directory's weights and JSON."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())


def plain_read(files: list[Path], cold: bool, chunk: int = 16 << 20) -> float:
    """Seconds to read ``files`` front to back (what no loader can beat), after dropping the page
    cache when ``cold``."""
    if cold:
        drop_page_cache()
    buf = bytearray(chunk)
    t0 = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t0


def drop_page_cache() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as exc:
        raise ValueError(f"--cold needs to drop the page cache (/proc/sys/vm/drop_caches, root): {exc}") from None


def reset_peak_rss() -> None:
    """Start the kernel's high-water mark of this process's resident memory (VmHWM) afresh."""
    with contextlib.suppress(OSError):  # not Linux, or an old kernel: the peak then covers the process so far
        Path("/proc/self/clear_refs").write_text("5\n")


def memory_status() -> dict[str, int]:
    """VmHWM (peak resident) and VmRSS of this process, in bytes (0 where /proc does not say)."""
    out = {"VmHWM": 0, "VmRSS": 0}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in out:
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


# --- output -------------------------------------------------------------------------------------


def format_record(r: dict[str, Any]) -> str:
    d, load = r["decode"], r["load"]
    pre = ", ".join(f"prefill {t}: {p['tokens_per_s']:.1f} tok/s" for t, p in r["prefill"].items())
    return (
        f"{r['variant']} (torch threads {r['torch_threads']}): load {load['s']:.1f} s "
        f"({load['vs_plain_read']:.2f}x a plain read of {load['stored_gb']:.2f} GB, peak RSS "
        f"{load['peak_rss_gb']:.2f} GB), decode {d['tokens_per_s']:.1f} tok/s "
        f"({d['ms_per_token']:.2f} ms, {d['vs_parts']:.2f}x the parts alone), {pre}"
    )


def format_table(result: dict[str, Any]) -> str:
    s = result["shape"]
    keys = list(result["records"][0]["prefill"]) if result["records"] else []
    lines = [
        f"model {result['model']}: {s['layers']} layers, hidden {s['hidden']}, {s['experts']} experts of "
        f"{s['intermediate']} top-{s['top_k']}, {s['heads']}/{s['kv_heads']} heads x {s['head_dim']}, vocab "
        f"{s['vocab']}; engine {result['isa']} with {result['engine_threads']} threads; decode after "
        f"{result['context']} tokens, medians of {result['repeats']} repeats",
        "",
        f"{'variant':22s} {'torch':>5s} {'decode':>8s} {'ms/tok':>7s} {'x parts':>7s} "
        + " ".join(f"{'pf' + t:>8s} {'x parts':>7s}" for t in keys),
    ]
    for r in result["records"]:
        d = r["decode"]
        row = f"{r['variant']:22s} {r['torch_threads']:5d} {d['tokens_per_s']:8.1f} {d['ms_per_token']:7.2f} "
        row += f"{d['vs_parts']:7.2f} "
        row += " ".join(f"{r['prefill'][t]['tokens_per_s']:8.1f} {r['prefill'][t]['vs_parts']:7.2f}" for t in keys)
        lines.append(row)
    for name, f in result["llama_cpp"].items():  # measured in this run (run_bench)
        label = "llama.cpp " + name.removesuffix(".gguf")[:12]
        row = f"{label:22s} {'-':>5s} {f['decode']:8.1f} {1e3 / f['decode']:7.2f} {'':7s} "
        row += " ".join(f"{f'{x:.1f}' if (x := f.get('prefill ' + t)) else '-':>8s} {'':7s}" for t in keys)
        lines.append(row)
    if not result["llama_cpp"]:
        lines.append("(llama.cpp not run: --llama-bench BIN --llama-gguf FILE,... measures it in this run)")
    lines += ["", "load (the plain read just before it; cold: page cache dropped before each):"]
    lines.append(
        f"{'variant':22s} {'load s':>7s} {'read s':>7s} {'x read':>7s} {'GB':>7s} {'peak GB':>8s} {'cold':>5s}"
    )
    for r in result["records"]:
        d = r["load"]
        lines.append(
            f"{r['variant']:22s} {d['s']:7.2f} {d['plain_read_s']:7.2f} {d['vs_plain_read']:7.2f} "
            f"{d['stored_gb']:7.2f} {d['peak_rss_gb']:8.2f} {'yes' if d['cold'] else 'no':>5s}"
        )
    header = f"{'variant':22s} {'torch':>5s} " + " ".join(f"{p:>19s}" for p in (*PARTS, "total"))
    lines += ["", "decode, ms per token by part (in the model | each part alone, summed over layers):", header]
    lines += [_split_row(r, r["decode"], 2) for r in result["records"]]
    for t in keys:
        lines += ["", f"prefill {t} tokens, ms by part (in the model | each part alone):", header]
        lines += [_split_row(r, r["prefill"][t], 1) for r in result["records"]]
    return "\n".join(lines)


def _split_row(record: dict[str, Any], phase: dict[str, Any], digits: int) -> str:
    split, alone = phase["split_ms"], phase["parts_alone_ms"]
    cells = [f"{split[p]:8.{digits}f} | " + (f"{alone[p]:8.{digits}f}" if p in alone else " " * 8) for p in PARTS]
    cells.append(f"{split['total']:8.{digits}f} | {alone['sum']:8.{digits}f}")
    return f"{record['variant']:22s} {record['torch_threads']:5d} " + " ".join(f"{c:>19s}" for c in cells)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    write_text_atomic(path, json.dumps(result, indent=1) + "\n")
