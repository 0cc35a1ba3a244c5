"""``hetmoe bench moe``: one MoE layer's routed experts at a real model's shape, per method and
token count, hetmoe's engine against the torch baseline in the same run, with the machine's
measured bandwidth and FMA peak as the roofline.

Routing is uniform random over all experts and redrawn every repetition, so decode streams its
experts from DRAM rather than from cache (the layer's experts are far larger than the caches at
real shapes). Times are medians over repetitions; min and max are kept.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels import moe_forward_reference, select_isa, set_num_threads
from ..kernels.cache_flush import CacheFlush, last_level_cache_bytes
from ..kernels.dispatch import pool_report
from ..kernels.machine import measure_machine, plain_read_gb_per_s, read_bandwidth_now
from ..models.shapes import MoEShape, get_shape
from ..runtime import CPUExperts
from .baseline import TorchExperts
from .layers import dequantize_expert, random_projection

DEFAULT_TOKENS = (1, 8, 32, 128, 512)
DECODE_TOKENS = 8  # rows up to this many tokens also time a plain read of their expert bytes


@dataclass
class BenchConfig:
    shape: str = "qwen3-30b-a3b"
    methods: tuple[str, ...] = ("bf16", "int8", "int4")
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    threads: int = 0
    experts: int | None = None  # scale the expert count down to fit memory
    group_size: int = 32
    baseline: bool = True
    isa: str = "auto"
    seed: int = 0
    min_seconds: float = 1.0  # per (method, tokens, impl): repeat until this much time is spent
    extra: dict[str, Any] = field(default_factory=dict)


def _reps(tokens: int) -> int:
    return 30 if tokens <= 8 else 10 if tokens <= 64 else 5


def _time(
    fn, prepare, reps: int, min_seconds: float, flush: CacheFlush, plain_bytes: float = 0, idle: tuple = ()
) -> tuple[list[float], list[float]]:
    """Times ``fn(*prepare())``; only ``fn`` is inside the clock (routing is drawn and the caches
    evicted outside it: in a model, the other layers' weights pass through the cache in between).
    ``idle``: arguments routing no token to any expert, run between the eviction and the clock. In a
    model the layer's code (Python, the engine's dispatch, the pool) ran a millisecond earlier for the
    previous layer and is in the cache; the eviction, 2x the last-level cache at once, takes it too,
    which no decode step does (measured on the AMX Xeon, int4 decode of one layer, alternating: 1.49
    ms evicted with its code, 1.20 with the code run again; waking the pool's threads alone: 1.47).
    With ``plain_bytes``, each repetition is followed by a plain read of that many bytes in random
    1 MiB chunks (its GB/s in the second list), after the same eviction and idle run as the timed call:
    interleaved, both see the machine in the same state. The idle run also wakes the pool's threads,
    which sleep through the eviction; a plain read that woke them itself took 0.93-1.06 ms for an int4
    layer's 21 MB against 0.68-0.70 ms after an idle run (AMX Xeon, 2 threads), so %read compared the
    layer on a woken pool with a read on a sleeping one."""
    fn(*prepare())  # warm-up: page in, allocate, spin up the pool

    def settle() -> None:  # the state the timed call and the plain read each start from
        flush()
        if idle:
            fn(*idle)

    times: list[float] = []
    plain: list[float] = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_seconds and len(times) < 10 * reps):
        args = prepare()
        settle()
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
        if plain_bytes:
            settle()
            plain.append(plain_read_gb_per_s(plain_bytes, reps=1, seed=len(times)))
    return times, plain


def _rel_err(
    shape: MoEShape, experts: int, layer: tuple, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, y: torch.Tensor
) -> float:
    """Relative error of ``y`` against the float64 reference built from the experts ``ids`` uses."""
    used = [e for e in ids.unique().tolist() if e >= 0]
    remap = torch.full((experts,), -1, dtype=torch.int64)
    remap[used] = torch.arange(len(used))
    deq = [torch.stack([dequantize_expert(q, e) for e in used]) for q in layer]
    ref = moe_forward_reference(x.float(), *deq, remap[ids.clamp(min=0)].masked_fill(ids < 0, -1), w)
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def run_bench(cfg: BenchConfig, log=print) -> dict[str, Any]:
    shape = get_shape(cfg.shape)
    experts = cfg.experts or shape.experts
    if experts < shape.top_k:
        raise ValueError(f"--experts {experts} is below the shape's top-k {shape.top_k}")
    isa = select_isa(cfg.isa)
    if cfg.threads:
        set_num_threads(cfg.threads)
    machine = measure_machine(cfg.threads or None)
    pool = pool_report()
    groups = len(pool.get("node_cpus", [[]]))
    log(
        f"machine: read {machine['read_gb_per_s']} GB/s, fp32 FMA {machine['fma_gflop_per_s']} GFLOP/s "
        f"({machine['threads']} threads, {machine['isa']}); kernels: {isa}"
        + (f"; experts split over {groups} NUMA groups ({pool['source']})" if groups > 1 else "")
    )
    flush = CacheFlush(2 * last_level_cache_bytes())
    records = []
    samples: list[float] = []  # every read-bandwidth sample of the run
    h, i, k = shape.hidden, shape.intermediate, shape.top_k
    for method in cfg.methods:
        layer = (
            random_projection(method, experts, i, h, cfg.group_size, cfg.seed),
            random_projection(method, experts, i, h, cfg.group_size, cfg.seed + 1),
            random_projection(method, experts, h, i, cfg.group_size, cfg.seed + 2),
        )
        impls: dict[str, Any] = {"hetmoe": CPUExperts(*layer, verbose=False)}
        if cfg.baseline:
            impls["torch"] = TorchExperts(*layer)
        bytes_per_expert = sum(q.nbytes for q in layer) / experts
        for tokens in cfg.tokens:
            gen = torch.Generator().manual_seed(cfg.seed + tokens)
            x = (torch.randn(tokens, h, generator=gen) * 0.5).bfloat16()
            idle = (x, torch.full((tokens, k), -1, dtype=torch.int64), torch.full((tokens, k), 1.0 / k))  # see _time
            for name, impl in impls.items():
                routings: list[int] = []

                def draw(gen=gen, tokens=tokens, x=x, routings=routings) -> tuple:
                    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
                    w = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
                    routings.append(len(ids.unique()))
                    return x, ids, w

                # torch's own OpenMP threads spin after each parallel region and would steal the
                # cores from the engine's workers; the engine runs with torch at one thread (as
                # hetmoe's runtime does around CPU-expert work), the torch baseline with its default.
                # The machine's own measurements run with torch at one thread as well.
                torch_threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    samples.append(read_bandwidth_now(cfg.threads or None))
                    torch.set_num_threads(1 if name == "hetmoe" else torch_threads)
                    # decode rows: as many expert bytes as the step touches (top-k of each token,
                    # nearly all distinct) read plainly between the repetitions
                    plain_bytes = min(experts, tokens * k) * bytes_per_expert
                    decode = name == "hetmoe" and tokens <= DECODE_TOKENS
                    times, plains = _time(
                        impl.forward, draw, _reps(tokens), cfg.min_seconds, flush, plain_bytes if decode else 0, idle
                    )
                    torch.set_num_threads(1)
                    # the better of the samples either side: the harder bar where the machine drifted
                    samples.append(read_bandwidth_now(cfg.threads or None))
                finally:
                    torch.set_num_threads(torch_threads)
                read_now = max(samples[-2:])
                active = statistics.median(routings)
                ms = statistics.median(times) * 1e3
                ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
                w = torch.softmax(torch.randn(tokens, k, generator=gen), -1)
                rel = _rel_err(shape, experts, layer, x, ids, w, impl.forward(x, ids, w))
                rec = {
                    "impl": name,
                    "method": method,
                    "tokens": tokens,
                    "threads": machine["threads"],
                    "isa": isa if name == "hetmoe" else "torch",
                    "ms": round(ms, 4),
                    "ms_min": round(min(times) * 1e3, 4),
                    "ms_max": round(max(times) * 1e3, 4),
                    "reps": len(times),
                    "active_experts": active,
                    "gb_per_s": round(active * bytes_per_expert / (ms / 1e3) / 1e9, 2),
                    "gflop_per_s": round(shape.layer_flops(tokens) / (ms / 1e3) / 1e9, 1),
                    "rel_err": float(f"{rel:.3g}"),
                }
                rec["bw_fraction"] = round(rec["gb_per_s"] / machine["read_gb_per_s"], 3)
                rec["read_gb_per_s_now"] = read_now
                rec["bw_fraction_now"] = round(rec["gb_per_s"] / read_now, 3)
                if plains:
                    # the read's bytes are the step's rounded down to whole chunks: compare rates
                    plain = round(statistics.median(plains), 2)
                    rec["plain_read_gb_per_s"] = plain
                    rec["plain_read_fraction"] = round(rec["gb_per_s"] / plain, 3)
                rec["peak_fraction"] = round(rec["gflop_per_s"] / machine["fma_gflop_per_s"], 3)
                records.append(rec)
                log(format_row(rec))
    return {
        "shape": shape.__dict__,
        "experts": experts,
        "group_size": cfg.group_size,
        "machine": machine,
        "pool": pool,
        "read_now_gb_per_s": {
            "min": min(samples, default=0.0),
            "median": statistics.median(samples) if samples else 0.0,
            "max": max(samples, default=0.0),
            "samples": len(samples),
        },
        "records": records,
    }


HEADER = (
    f"{'impl':7s} {'method':6s} {'tokens':>6s} {'ms':>9s} {'min':>9s} {'max':>9s} {'GB/s':>7s} {'%BW':>5s} "
    f"{'read now':>8s} {'%now':>5s} {'%read':>5s} {'GFLOP/s':>8s} {'%peak':>6s} {'rel_err':>8s}"
)


def format_row(r: dict[str, Any]) -> str:
    plain = f"{r['plain_read_fraction'] * 100:.0f}" if "plain_read_fraction" in r else ""
    return (
        f"{r['impl']:7s} {r['method']:6s} {r['tokens']:6d} {r['ms']:9.3f} {r['ms_min']:9.3f} {r['ms_max']:9.3f} "
        f"{r['gb_per_s']:7.2f} {r['bw_fraction'] * 100:5.0f} {r['read_gb_per_s_now']:8.1f} "
        f"{r['bw_fraction_now'] * 100:5.0f} {plain:>5s} {r['gflop_per_s']:8.1f} {r['peak_fraction'] * 100:6.0f} "
        f"{r['rel_err']:8.1e}"
    )


def _samples_line(read_now: dict[str, Any] | None) -> str:
    if not read_now or not read_now["samples"]:
        return ""
    return (
        f"; this run's {read_now['samples']} samples: {read_now['min']:.1f}-{read_now['max']:.1f} GB/s, "
        f"median {read_now['median']:.1f}"
    )


def format_table(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"MoE layer {result['shape']['name']} (hidden {result['shape']['hidden']}, intermediate "
        f"{result['shape']['intermediate']}, {result['experts']} experts, top-{result['shape']['top_k']}); "
        f"roofline: {m['read_gb_per_s']} GB/s read, {m['fma_gflop_per_s']} GFLOP/s fp32 FMA, {m['threads']} threads",
        "%BW: of the doctor's (cached) read bandwidth; read now, %now: the bandwidth measured beside each row "
        "(the better of a sample before and after it), and the row's fraction of it; %read (decode rows): of a plain "
        "read of as many bytes in random 1 MiB chunks on the engine's threads, timed beside the row"
        + _samples_line(result.get("read_now_gb_per_s")),
        HEADER,
    ]
    lines += [format_row(r) for r in result["records"]]
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def plot_roofline(result: dict[str, Any], path: str) -> None:
    """Achieved GFLOP/s against arithmetic intensity, under the bandwidth and FMA roofs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib") from None
    m = result["machine"]
    fig, ax = plt.subplots(figsize=(7, 5))
    ridge = m["fma_gflop_per_s"] / m["read_gb_per_s"]  # flop/byte where bandwidth stops limiting
    roof_x = [0.05, ridge, 1000]
    roof_y = [0.05 * m["read_gb_per_s"], m["fma_gflop_per_s"], m["fma_gflop_per_s"]]
    ax.plot(roof_x, roof_y, "k-", label="roofline (measured read bandwidth, FMA peak)")
    for r in result["records"]:
        intensity = r["gflop_per_s"] / max(r["gb_per_s"], 1e-9)
        marker = "o" if r["impl"] == "hetmoe" else "x"
        ax.scatter(intensity, r["gflop_per_s"], marker=marker, label=f"{r['impl']} {r['method']} T={r['tokens']}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("flop per byte of expert weights")
    ax.set_ylabel("GFLOP/s")
    ax.set_title(f"MoE layer {result['shape']['name']}: {m['threads']} threads")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
