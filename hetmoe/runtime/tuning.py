"""The engine's choices measured on this machine instead of guessed from the vendor (FFTW's wisdom).

What is fastest differs between CPUs more than any rule of thumb says: on a Zen 5 the 512-bit integer
GEMVs win, on an Intel Xeon with AMX the 512-bit GEMVs win at 1-128 tokens while AMX tiles win at 512
(measured, docs/benchmarks.md). So, once per (CPU model, threads, kernel variant), the tuner times:

- the GEMVs' width (256 or 512 bits, AVX-512 variants only), for the 4- to 6-bit GEMVs on int4,
  Q4_0, Q4_K and Q6_K together, the int16-code ones on int8, and bf16's VDPBF16PS loop on bf16 and
  fp8 (where the CPU has AVX512-BF16; fp8's GEMV is timed with it, its width unchanged), each on
  decode (the layer's experts and a dense MLP's long GEMVs) and on 8 tokens an expert apart (the
  engine runs a job whose busiest expert has at most 4 tokens at the decode width);
- how the GEMVs prefetch the weights they stream (into every cache level, into L2 but not L1,
  non-temporally, or not at all), per family on the decode of its methods together (bf16 and fp8;
  int8; int4, Q4_0, Q4_K and Q6_K): on an AMX Xeon non-temporal took 1.3-2.4x as long and L2 was the
  fastest; on a Zen 5 non-temporal was;
- for each method family, the GEMV/GEMM switch point (``gemv_max_tokens``): the GEMV path against
  the GEMM path (AMX tiles where the variant has them; else, for the bf16 activations timed here,
  VDPBF16PS on rows rounded to bf16 where the CPU has AVX512-BF16; else dequantized fp32 panels) at 2 to 64
  tokens an expert (one token an expert, a decode step, always takes the GEMV); the switch is where
  the two times cross, between the last count at which the GEMM path was not more than 10% faster
  and the first at which it was.

Each is timed on a Qwen3-30B-A3B-shaped layer (128 experts of 2048 x 768, top-8, random routing; up
to ~4.5 GB for the seven layouts and their dense MLPs, ~1.5 minutes in all), alternating the
candidates with the caches evicted before each run (as a model's other layers evict them) and
keeping each one's best of three (the widths: best of 15 decodes, of 5 prompts; the prefetch: medians
of 15).
The choices are cached beside the doctor's figures (``$XDG_CACHE_HOME/hetmoe/tuning.json``), made on
first use (``HETMOE_TUNE=0`` turns tuning off: the built-in defaults then apply) or by
``hetmoe doctor --tune``, and printed by ``hetmoe doctor``. ``HETMOE_INT_VECTOR_BITS``,
``HETMOE_WEIGHT_PREFETCH`` and an explicit ``gemv_max_tokens`` still override them. Work-item size is
not tuned (a fixed 1 MiB, measured on Zen 5: csrc/engine_common.h).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.atomic import write_text_atomic
from ..formats.random_layout import random_projection
from ..kernels.cache_flush import CacheFlush, last_level_cache_bytes
from ..kernels.dispatch import (
    INT_VECTOR_BITS_ENV,
    PREFETCH_CHOICES,
    PREFETCH_FAMILIES,
    WEIGHT_PREFETCH_ENV,
    WIDTH_FAMILIES,
    WIDTH_REGIMES,
    engine_module,
    set_int_vector_bits,
    set_weight_prefetch,
)
from ..kernels.machine import cache_path
from .engine_layout import GEMV_ALL_TOKENS, prefetch_family

TUNE_ENV = "HETMOE_TUNE"
# 19: the int4 (512-bit) and int8 (256-bit) decode GEMVs read two rows at once, the activation quantizer and the
# decode down projection cost less around the GEMVs (the prefetch hint is measured again); 18: the
# bf16 GEMV on bf16 activations has a width of its own (on an AMX Xeon 256 bits streamed a bf16
# layer 8-15% faster than 512); 17: the integer GEMVs prefetch again (from version 16's commit
# on, the compiler had deleted their prefetches, so the 4-bit and int8 families were tuned with
# every hint a no-op), and each family's width and prefetch are timed on all its tuned methods
# together; 16: the weight
# prefetch per family of GEMVs (on a Zen 4 the 4-bit ones have at times streamed faster with a
# software prefetch, bf16 without); 15: the weight prefetch has a fourth candidate,
# none (the bf16 GEMV on bf16 activations streams faster without it on a Zen 4); 14: the weight
# prefetch has a third candidate, T1; 13: the AMX digit GEMMs convert their sums behind the next
# tile's products (the GEMV/GEMM switch points move);
# 12: each candidate runs with its code in cache, as in a model (11: the layers it times are on huge
# pages, as a model's weights are; 10: the integer GEMVs' width per family and regime; 9: 4-bit
# GEMMs on AMX take int8 digit tiles)
TUNING_VERSION = 19
# Method families: the methods whose GEMV and GEMM paths share kernels and costs closely enough that
# one measurement serves them all.
FAMILIES: dict[str, str] = {
    "bf16": "bf16",
    "fp8": "fp8",
    "fp8-channel": "fp8",
    "int8": "int8",
    "gguf:q8_0": "int8",
    "int4": "int4",
    "int4-asym": "int4",
    "gptq": "int4",
    "mxfp4": "int4",
    # GGUF's 4-bit types run their own GEMVs (natural-order int16 activations), slower a token than
    # int4's, so their switch differs: Q4_0 at 512 tokens took 235-274 ms with int4's default switch
    # (32) and 127-154 ms at 12 (AMX Xeon, 2 threads). The K-quants share one measurement.
    "gguf:q4_0": "q4_0",
    "gguf:q5_0": "q4_0",
    "gguf:q4_k": "q4_k",
    "gguf:q5_k": "q4_k",
    "gguf:q6_k": "q4_k",
}
TUNED_METHODS = ("bf16", "fp8", "int8", "int4", "gguf:q4_0", "gguf:q4_k")
# The GEMV families' widths and prefetches are timed on these: Q6_K too, the lm_head (and half the
# ffn_down) of llama-quantize's 4-bit files, which on the AMX Xeon streamed 15% faster at 512 bits
# (a 102400 x 2048 GEMV from DRAM) where int4 timed alike at both widths.
FAMILY_METHODS = (*TUNED_METHODS, "gguf:q6_k")
TOKENS_PER_EXPERT = (1, 2, 4, 8, 16, 24, 32, 48, 64)  # the first: a decode step's
# The GEMM path takes over only where it is more than 10% faster: on a shared VM two runs of the same
# configuration differ by that much (a bf16 decode step here: 4.2 and 5.3 ms in one tuning run), and
# near the switch the two paths are within it, so a closer call is noise.
SWITCH_MARGIN = 1.1
# Qwen3-30B-A3B's layer (128 experts of 2048 x 768, top-8), as the benchmarks time it: a smaller
# layer (16 experts, every expert given the same tokens) put the switches off by 2-4x.
EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 128, 2048, 768, 8

_choices: dict[str, Any] | None = None


def tuning_path() -> Path:
    return cache_path().with_name("tuning.json")


def _key() -> str:
    from ..hw import cpu_info

    mod = engine_module()
    return f"{cpu_info().model}|{mod.num_threads() or cpu_info().usable_cpus}|{mod.selected_isa()}|v{TUNING_VERSION}"


def _layer(method: str) -> list:
    return [
        random_projection(method, EXPERTS, INTERMEDIATE, HIDDEN, 32, 0),
        random_projection(method, EXPERTS, INTERMEDIATE, HIDDEN, 32, 1),
        random_projection(method, EXPERTS, HIDDEN, INTERMEDIATE, 32, 2),
    ]


# A dense MLP as one expert of DENSE_INTERMEDIATE x HIDDEN (a 1-token decode through it: two GEMVs of
# 16384 rows of 2048, one of 2048 rows of 16384): a decode step's attention, dense layers and lm_head
# are such long GEMVs, ~40% of a Qwen3-30B-A3B step's weights, and they can prefer another width
# than the experts' short ones: on the AMX Xeon a Qwen3-MoE Q4_K_M model decoded 10% faster with
# 512-bit GEMVs while its MoE layer alone timed 256 and 512 bits within 1%.
DENSE_INTERMEDIATE = 16384


def _dense(method: str) -> list:
    return [
        random_projection(method, 1, DENSE_INTERMEDIATE, HIDDEN, 32, 3),
        random_projection(method, 1, DENSE_INTERMEDIATE, HIDDEN, 32, 4),
        random_projection(method, 1, HIDDEN, DENSE_INTERMEDIATE, 32, 5),
    ]


def _inputs(tokens_per_expert: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens routed uniformly at random, ``tokens_per_expert`` an expert on average (one: a decode
    step's single token): experts get every count around the average, as in a real prefill."""
    T = max(1, tokens_per_expert * EXPERTS // TOP_K) if tokens_per_expert > 1 else 1
    g = torch.Generator().manual_seed(seed + T)
    ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(T)])
    x = (torch.randn(T, HIDDEN, generator=g) * 0.5).bfloat16()
    return x, ids, torch.softmax(torch.randn(T, TOP_K, generator=g), -1)


def _forward_all(steps: dict[str, tuple[Any, Any]], family: str, inputs: tuple, dense: bool) -> None:
    """One forward of each of ``steps``' MoE layers (``{method: (CPUExperts, dense CPUExperts)}``)
    whose GEMVs are of ``family`` (engine_layout's prefetch_family: the integer family, or bf16 for
    float arithmetic), one after another, each followed by its dense MLP where ``dense`` (a decode
    step's shapes; the dense one takes each token to its one expert). A family is timed on all its
    tuned methods, not on the one that names it: on the AMX Xeon, int4 decoded as fast with T0 as with
    T1 while Q4_K's GEMV (another loop at 256 bits) streamed 14.8 GB/s with T0 and 18.1 with T1, and
    Q4_0's 16.4 and 18.6."""
    x, ids, w = inputs
    for m, (moe, mlp) in steps.items():
        if prefetch_family(m) == family:
            moe.forward(*inputs)
            if dense:
                mlp.forward(x, ids[:, :1].clamp(min=-1, max=0), torch.ones_like(w[:, :1]))


_flush: CacheFlush | None = None


def _candidate_times(runs: dict[str, Any], inputs: tuple, reps: int = 3, stat: Any = min) -> dict[str, float]:
    """The best of ``reps`` seconds (or another ``stat`` of them) of each candidate (a callable running one
    forward), alternating, each after the caches were evicted: the small layer would otherwise sit in
    a large L3 (300 MiB on a Xeon here), while a real model's layers stream from DRAM. Between the
    eviction and the clock each runs once with no token routed: in a model the layer's code ran a
    millisecond earlier and is in the cache, the weights are not (bench/moe.py's _time)."""
    global _flush
    if _flush is None:
        _flush = CacheFlush(2 * last_level_cache_bytes())
    x, ids, w = inputs
    idle = (x, torch.full_like(ids, -1), w)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            _flush()
            run(*idle)
            t0 = time.perf_counter()
            run(*inputs)
            seconds[name].append(time.perf_counter() - t0)
    return {name: stat(v) for name, v in seconds.items()}


def tune(log=None) -> dict[str, Any]:
    """Measure every choice on this machine, cache and apply them, and return the record."""
    from .cpu_experts import CPUExperts

    log = log or (lambda _msg: None)
    mod = engine_module()
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the runtime runs the engine: torch's OpenMP workers off the cores
    started = time.perf_counter()
    record: dict[str, Any] = {"isa": mod.selected_isa(), "gemv_max": {}, "timings_ms": {}}
    try:
        layers = {m: _layer(m) for m in FAMILY_METHODS}
        widths = (256, 512) if mod.selected_isa() != "avx2" else (256,)
        # Each family's width in each regime on its own: the families and regimes disagree (an AMD Zen 4:
        # int8 decode faster at 256 bits, int8 at 8 tokens an expert and int4 throughout at 512).
        chosen = {f: dict.fromkeys(WIDTH_REGIMES, widths[0]) for f in WIDTH_FAMILIES}
        steps = {  # each method's layer and a dense MLP, both on the GEMV path
            m: tuple(CPUExperts(*p, gemv_max_tokens=GEMV_ALL_TOKENS, verbose=False) for p in (layers[m], _dense(m)))
            for m in FAMILY_METHODS
        }
        if len(widths) > 1:
            for regime, label, inputs, reps, dense in (
                ("decode", "decode", _inputs(1), 15, True),  # a decode step: the experts and a dense MLP
                ("prompt", "8 tokens/expert", _inputs(8), 5, False),
            ):
                for m in WIDTH_FAMILIES:
                    runs = {
                        str(b): (
                            lambda *a, b=b, m=m, d=dense, s=steps: (set_int_vector_bits(b, m), _forward_all(s, m, a, d))
                        )
                        for b in widths
                    }
                    times = _candidate_times(runs, inputs, reps=reps)
                    record["timings_ms"][f"{m} gemv {label}"] = {b: round(v * 1e3, 3) for b, v in times.items()}
                    chosen[m][regime] = min(widths, key=lambda b: times[str(b)])
            log(f"tuned the GEMVs' widths: {chosen}")
        record["int_vector_bits"] = chosen
        env_bits = os.environ.get(INT_VECTOR_BITS_ENV, "").strip()
        if env_bits:  # the override holds for this process; the switches below are measured with it
            set_int_vector_bits(int(env_bits))
        else:
            apply_widths(chosen)
        # How each family of GEMVs prefetches the rows it streams (dispatch.PREFETCH_CHOICES), on
        # decode steps (the experts and a dense MLP) of its methods (dispatch.PREFETCH_FAMILIES).
        record["weight_prefetch"] = {}
        decode = _inputs(1)
        for m in PREFETCH_FAMILIES:
            runs = {
                h: (lambda *a, h=h, m=m, s=steps: (set_weight_prefetch(h, m), _forward_all(s, m, a, True)))
                for h in PREFETCH_CHOICES
            }
            # medians of 15: the hints differ by a few percent, less than a best-of-5 varies by on a VM
            times = _candidate_times(runs, decode, reps=15, stat=statistics.median)
            record["timings_ms"][f"{m} decode prefetch"] = {h: round(v * 1e3, 3) for h, v in times.items()}
            record["weight_prefetch"][m] = min(times, key=lambda h: times[h])
        del steps  # the switch points below build their own, on TUNED_METHODS' layers only
        layers = {m: layers[m] for m in TUNED_METHODS}
        env_hint = os.environ.get(WEIGHT_PREFETCH_ENV, "").strip().lower()
        if env_hint:  # the override holds for this process (as the width's); the switches are measured with it
            set_weight_prefetch(env_hint)
        else:
            apply_prefetches(record["weight_prefetch"])  # the switch points below are measured with them
        log(f"tuned the GEMVs' weight prefetch: {record['weight_prefetch']}")
        for m in TUNED_METHODS:
            paths = {
                "gemv": CPUExperts(*layers[m], gemv_max_tokens=GEMV_ALL_TOKENS, verbose=False),
                "gemm": CPUExperts(*layers[m], gemv_max_tokens=0, verbose=False),
            }
            # One token an expert (a decode step) always streams through the GEMV: each weight read once
            # is the whole cost there, and the small layer here misjudged it (bf16: tiles looked faster
            # at 16 experts, the GEMV was 15% faster at Qwen3-30B-A3B's 128).
            switch, last = 1, None
            for tpe in TOKENS_PER_EXPERT[1:]:
                times = _candidate_times({k: ce.forward for k, ce in paths.items()}, _inputs(tpe), reps=3)
                record["timings_ms"][f"{m} {tpe} tokens/expert"] = {k: round(v * 1e3, 3) for k, v in times.items()}
                if times["gemv"] > SWITCH_MARGIN * times["gemm"]:
                    if last is not None:
                        switch = _crossing(switch, last, tpe, times)
                    break
                switch, last = tpe, times
            else:  # GEMV still competitive at the largest count measured: it takes every count
                switch = GEMV_ALL_TOKENS
            record["gemv_max"][FAMILIES[m]] = switch
            log(f"tuned {m}: GEMV up to {_describe(switch)} tokens an expert")
    finally:
        torch.set_num_threads(torch_threads)
    record["seconds"] = round(time.perf_counter() - started, 1)
    record["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    _store(record)
    global _choices
    _choices = record
    apply(record)
    return record


def _crossing(a: int, at_a: dict[str, float], b: int, at_b: dict[str, float]) -> int:
    """Where the GEMV's time (linear in the tokens) meets the GEMM's, between counts a and b, as a
    whole count: real routings give experts every count around the average, so the grid's last
    count below the switch would send the experts just above it to the slower path."""
    gemv_slope = (at_b["gemv"] - at_a["gemv"]) / (b - a)
    gemm_slope = (at_b["gemm"] - at_a["gemm"]) / (b - a)
    if gemv_slope <= gemm_slope:
        return a
    return max(a, min(b - 1, int(a + (at_a["gemm"] - at_a["gemv"]) / (gemv_slope - gemm_slope))))


def _describe(gemv_max: int) -> str:
    return "every" if gemv_max >= GEMV_ALL_TOKENS else str(gemv_max)


def _store(record: dict[str, Any]) -> None:
    path = tuning_path()
    cache: dict[str, Any] = {}
    try:
        cache = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        cache = {}
    cache[_key()] = record
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(cache, indent=1))
    except OSError:  # a read-only home is no reason to fail: the choices hold for this process
        pass


def cached() -> dict[str, Any] | None:
    """This machine's cached record, or None."""
    try:
        cache = json.loads(tuning_path().read_text())
    except (OSError, ValueError):
        return None
    record = cache.get(_key())
    return record if isinstance(record, dict) and isinstance(record.get("gemv_max"), dict) else None


def apply(record: dict[str, Any]) -> None:
    """The record's GEMV width and weight prefetch, unless HETMOE_INT_VECTOR_BITS /
    HETMOE_WEIGHT_PREFETCH say otherwise."""
    widths = record.get("int_vector_bits")
    if isinstance(widths, dict) and not os.environ.get(INT_VECTOR_BITS_ENV, "").strip():
        apply_widths(widths)
    hints = record.get("weight_prefetch")
    if isinstance(hints, dict) and not os.environ.get(WEIGHT_PREFETCH_ENV, "").strip():
        apply_prefetches(hints)


def apply_prefetches(hints: dict[str, Any]) -> None:
    """Set each family's weight prefetch that ``hints`` gives (a record's ``weight_prefetch``, or
    kernels.dispatch.weight_prefetches() taken earlier); entries naming no family or hint are
    skipped (a cache file is not trusted)."""
    for family, hint in hints.items():
        if family in PREFETCH_FAMILIES and hint in PREFETCH_CHOICES:
            set_weight_prefetch(hint, family)


def apply_widths(widths: dict[str, Any]) -> None:
    """Set each family's width in each regime that ``widths`` gives (a record's ``int_vector_bits``, or
    kernels.dispatch.int_vector_widths() taken earlier); entries naming no family, regime or width are
    skipped (a cache file is not trusted)."""
    for family, regimes in widths.items():
        if family in WIDTH_FAMILIES and isinstance(regimes, dict):
            for regime, bits in regimes.items():
                if regime in WIDTH_REGIMES and bits in (256, 512):
                    set_int_vector_bits(int(bits), family, regime)


def choices() -> dict[str, Any] | None:
    """The tuned choices for this machine: cached, or measured now on first use (one line on stderr;
    about a minute); None where ``HETMOE_TUNE=0`` (the built-in defaults, cached choices or not)."""
    global _choices
    if os.environ.get(TUNE_ENV, "1").strip() == "0":
        return None
    if _choices is not None and _choices.get("isa") == engine_module().selected_isa():
        return _choices
    record = cached()
    if record is None:
        print(
            f"hetmoe: measuring this machine's fastest kernel settings once, about a minute (cached in "
            f"{tuning_path()}; {TUNE_ENV}=0 skips)",
            file=sys.stderr,
        )
        record = tune()
    _choices = record
    apply(record)
    return record


def tuned_gemv_max(method: str) -> int | None:
    """The measured GEMV/GEMM switch for ``method``'s family, or None (untuned, or no family)."""
    family = FAMILIES.get(method)
    record = choices() if family else None
    if record is None:
        return None
    value = record["gemv_max"].get(family)
    return int(value) if isinstance(value, int) else None
