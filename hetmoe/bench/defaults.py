"""The default configuration against every configuration the tuner chooses between (issue 23).

``hetmoe bench defaults``: for each method and token count of ``hetmoe bench moe``, one
Qwen3-30B-A3B-shaped layer (128 experts of 2048 x 768, top-8, routing drawn uniformly at random each
run, as the tuner and ``bench moe`` build it) runs under every candidate of the choices the tuner makes
(runtime/tuning.py):

- the kernel variant, where the CPU runs AMX tiles as well as the AVX-512 kernels;
- the integer GEMVs' width, 256 or 512 bits (AVX-512 variants; integer methods only: bf16's GEMV is
  the same at both);
- how the GEMVs prefetch the weights they stream: into every cache level (``t0``), into L2 but not
  L1 (``t1``) or non-temporally (``nta``);
- the GEMV/GEMM switch (``gemv_max_tokens``): every expert on the GEMM path (0), on the GEMV path
  (every count), or the switch at each count of the tuner's grid.

The candidates alternate, in a new order each round (shuffled, seeded: no candidate follows the same
one every round, as the default did the list's last entry when the rounds were rotations of one
list), each run after the caches were evicted, ``reps`` rounds; each one's median is compared with
the default's (the tuned choices, as ``load_model`` applies them). The issue asks the default to be
within 10% of the best at every count; on a shared VM two runs of one configuration differ by about
that much, so the table gives the spread of the default's own runs beside the ratio.

The fastest of some thirty noisy medians is a low draw more often than a faster configuration: at 1
token, where the AMX and AVX-512 variants and every switch run the same GEMV, one sweep on the AMX
Xeon had the same code's medians 1.88-2.18 ms and put the default 1.12x the best. So where another
configuration is fastest, the two then alternate ``confirm`` more rounds on their own (which goes
first alternating too) and the ratio is theirs; the sweep's stays beside it.
"""

from __future__ import annotations

import itertools
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..formats.random_layout import random_projection
from ..kernels import select_isa, set_num_threads
from ..kernels.cache_flush import CacheFlush, last_level_cache_bytes
from ..kernels.dispatch import (
    PREFETCH_CHOICES,
    engine_module,
    int_vector_widths,
    set_int_vector_bits,
    set_weight_prefetch,
    weight_prefetches,
)
from ..runtime.cpu_experts import CPUExperts, default_gemv_max
from ..runtime.engine_layout import GEMV_ALL_TOKENS, WIDE_GEMV_METHODS, gemv_width_family, prefetch_family
from ..runtime.tuning import (
    EXPERTS,
    HIDDEN,
    INTERMEDIATE,
    TOKENS_PER_EXPERT,
    TOP_K,
    apply_prefetches,
    apply_widths,
    choices,
)
from .moe import DEFAULT_TOKENS

BOUND = 1.10  # the issue's: the default within 10% of the best configuration


@dataclass(frozen=True)
class Config:
    """One configuration: kernel variant, integer GEMV width, weight prefetch (of the method's family),
    GEMV/GEMM switch."""

    isa: str
    bits: int  # the method's integer GEMVs' width; 0: the tuned widths (one per regime: decode, prompt)
    prefetch: str
    gemv_max: int

    def label(self) -> str:
        switch = "gemv" if self.gemv_max >= GEMV_ALL_TOKENS else "gemm" if self.gemv_max == 0 else f"g{self.gemv_max}"
        return f"{self.isa}/b{self.bits or 'T'}/{self.prefetch}/{switch}"


@dataclass
class DefaultsConfig:
    methods: tuple[str, ...] = ("bf16", "int8", "int4")
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    threads: int = 0
    reps: int = 5
    confirm: int = 15  # rounds of the default against the sweep's fastest, head to head; 0: none
    seed: int = 0
    # the layer: the tuner's (Qwen3-30B-A3B's); tests shrink it
    experts: int = EXPERTS
    hidden: int = HIDDEN
    intermediate: int = INTERMEDIATE
    top_k: int = TOP_K


def default_config(layer: list[Any], isa: str, prefetch: str) -> Config:
    """What an engine created for ``layer`` runs with: the variant, prefetch and integer GEMV widths in
    force before the run (the tuned ones unless the environment overrides them) and the tuned switch
    (or, with tuning off, the built-in one: cpu_experts.default_gemv_max)."""
    return Config(isa, 0, prefetch, default_gemv_max(layer))


def candidates(method: str, default: Config, isas: tuple[str, ...], tokens: int) -> list[Config]:
    """Every configuration the tuner chooses between for ``method`` that can differ at ``tokens``
    tokens, the default first. An expert gets at most ``tokens`` of them, so every switch at or above
    that count runs as "every expert on the GEMV path": one of them stands for all."""

    def effective(switch: int) -> int:
        return GEMV_ALL_TOKENS if switch >= tokens else switch

    # the methods whose GEMV width is a choice: the integer GEMVs (engine_layout.WIDE_GEMV_METHODS) and
    # bf16's VDPBF16PS loop
    widths = (256, 512) if method in (*WIDE_GEMV_METHODS, "bf16") and default.isa != "avx2" else (default.bits,)
    widths = (default.bits, *widths)  # the tuned widths, then each width for every regime
    switches = sorted(
        {effective(s) for s in (0, GEMV_ALL_TOKENS, *TOKENS_PER_EXPERT[1:])} - {effective(default.gemv_max)}
    )
    out = [default]
    for isa, bits, prefetch, switch in itertools.product(
        isas, widths, PREFETCH_CHOICES, [effective(default.gemv_max), *switches]
    ):
        if switch == 0 and bits != default.bits:
            continue  # every expert on the GEMM path: no GEMV runs, its width changes nothing
        c = Config(isa, bits, prefetch, switch)
        same_as_default = (isa, bits, prefetch, switch) == (
            default.isa,
            default.bits,
            default.prefetch,
            effective(default.gemv_max),
        )
        if not same_as_default and c not in out:
            out.append(c)
    return out


def _isas() -> tuple[str, ...]:
    """The variants to compare: the selected one, and AVX-512 beside AMX tiles."""
    selected = engine_module().selected_isa()
    return (selected, "avx512") if selected == "amx" else (selected,)


def _four_digits(ms: float) -> float:
    """A median in milliseconds (or a ratio of two) to four significant digits. A fixed number of
    decimals would lose up to a few percent of a tiny layer's ~0.02 ms (or of a ratio far below 1),
    and the ratios beside it would no longer follow from the figures printed."""
    return float(f"{ms:.4g}")


def _inputs(cfg: DefaultsConfig, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(cfg.experts, generator=gen)[: cfg.top_k] for _ in range(tokens)])
    x = (torch.randn(tokens, cfg.hidden, generator=gen) * 0.5).bfloat16()
    return x, ids, torch.softmax(torch.randn(tokens, cfg.top_k, generator=gen), -1)


def run_defaults(cfg: DefaultsConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    if cfg.threads:
        set_num_threads(cfg.threads)
    if cfg.reps < 1 or cfg.confirm < 0:
        raise ValueError(f"reps must be >= 1 and confirm >= 0, got {cfg.reps} and {cfg.confirm}")
    choices()  # tune first where this machine has no record: the default is the tuned choices
    isas = _isas()
    mod = engine_module()
    selected = mod.selected_isa()
    # the defaults, read before any candidate changes them, and put back at the end
    widths, prefetches = int_vector_widths(), weight_prefetches()
    flush = CacheFlush(2 * last_level_cache_bytes())
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runtime runs the engine: torch's OpenMP workers off the cores
    records: list[dict[str, Any]] = []
    try:
        for method in cfg.methods:
            layer = [
                random_projection(method, cfg.experts, n, k, 32, cfg.seed + i)
                for i, (n, k) in enumerate(
                    ((cfg.intermediate, cfg.hidden), (cfg.intermediate, cfg.hidden), (cfg.hidden, cfg.intermediate))
                )
            ]
            default = default_config(layer, selected, prefetches[prefetch_family(method)])
            family = gemv_width_family(method)
            engines: dict[tuple[str, int], CPUExperts] = {}
            for tokens in cfg.tokens:
                configs = candidates(method, default, isas, tokens)
                for c in configs:
                    if (c.isa, c.gemv_max) not in engines:
                        select_isa(c.isa)
                        engines[(c.isa, c.gemv_max)] = CPUExperts(*layer, gemv_max_tokens=c.gemv_max, verbose=False)
                select_isa(selected)
                gen = torch.Generator().manual_seed(cfg.seed + tokens)

                def run_once(c: Config) -> float:
                    if c.bits:
                        set_int_vector_bits(c.bits, family)  # noqa: B023 (called before the loops move on)
                    else:
                        apply_widths(widths)
                    set_weight_prefetch(c.prefetch, prefetch_family(method))  # noqa: B023
                    engine = engines[(c.isa, c.gemv_max)]  # noqa: B023
                    x, ids, w = _inputs(cfg, tokens, gen)  # noqa: B023
                    flush()
                    engine(x, torch.full_like(ids, -1), w)  # the code back in cache (bench/moe.py's _time)
                    t0 = time.perf_counter()
                    engine(x, ids, w)
                    return time.perf_counter() - t0

                times: dict[Config, list[float]] = {c: [] for c in configs}
                for rep in range(cfg.reps):
                    order = list(configs)
                    random.Random(cfg.seed * 1000 + rep).shuffle(order)  # no fixed neighbours
                    for c in order:
                        times[c].append(run_once(c))
                medians = {c: statistics.median(v) * 1e3 for c, v in times.items()}
                best = min(medians, key=lambda c: medians[c])
                sweep_ratio = medians[default] / medians[best]
                own = times[default]
                head: dict[Config, list[float]] = {default: [], best: []}
                if best != default:
                    for rnd in range(cfg.confirm):
                        for c in (default, best) if rnd % 2 == 0 else (best, default):
                            head[c].append(run_once(c))
                if head[default]:
                    default_ms, best_ms = (statistics.median(head[c]) * 1e3 for c in (default, best))
                else:
                    default_ms, best_ms = medians[default], medians[best]
                rec = {
                    "method": method,
                    "tokens": tokens,
                    "default": default.label(),
                    "default_ms": _four_digits(default_ms),
                    "default_spread": round(max(own) / min(own), 3),
                    "best": best.label(),
                    "best_ms": _four_digits(best_ms),
                    # four significant digits: head to head the ratio may lie far from 1
                    "ratio": _four_digits(default_ms / best_ms),
                    "sweep_ratio": _four_digits(sweep_ratio),
                    "confirm_rounds": len(head[default]),
                    "candidates": {c.label(): _four_digits(m) for c, m in medians.items()},
                }
                records.append(rec)
                log(format_row(rec))
    finally:
        torch.set_num_threads(torch_threads)
        select_isa(selected)
        apply_widths(widths)
        apply_prefetches(prefetches)
    layer = f"{cfg.experts} experts of {cfg.hidden} x {cfg.intermediate}, top-{cfg.top_k}"
    return {
        "threads": engine_module().num_threads(),
        "isa": selected,
        "reps": cfg.reps,
        "confirm": cfg.confirm,
        "layer": layer,
        "records": records,
    }


HEADER = (
    f"{'method':7s} {'tokens':>6s}  {'default':24s} {'ms':>9s} {'spread':>6s}  {'best':24s} {'ms':>9s} {'ratio':>6s}"
    f" {'sweep':>6s}"
)


def format_row(r: dict[str, Any]) -> str:
    mark = "" if r["ratio"] <= BOUND else f"  > {BOUND}"
    return (
        f"{r['method']:7s} {r['tokens']:6d}  {r['default']:24s} {r['default_ms']:9.3f} {r['default_spread']:6.2f}  "
        f"{r['best']:24s} {r['best_ms']:9.3f} {r['ratio']:6.2f} {r['sweep_ratio']:6.2f}{mark}"
    )


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"the default against every configuration the tuner chooses between: {result['layer']}, "
        f"{result['threads']} threads, {result['isa']}, median of {result['reps']} runs each, caches evicted",
        "configurations: variant/GEMV bits/prefetch/switch (bT: the tuned widths, decode's and prompts'; gemm: "
        "every expert on the GEMM path, gemv: on the GEMV path, gN: the GEMV up to N tokens an expert); spread: "
        "the default's slowest run over its fastest; ms and ratio: the default and the sweep's fastest head to "
        f"head, {result['confirm']} rounds alternating (the sweep's medians where the default was fastest); sweep: "
        "the ratio of the sweep's medians",
        HEADER,
    ]
    lines += [format_row(r) for r in result["records"]]
    worst = max((r["ratio"] for r in result["records"]), default=1.0)
    lines.append(f"worst default/best: {worst:.2f} (the issue's bound {BOUND})")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=1))
