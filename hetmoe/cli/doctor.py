"""``hetmoe doctor``: what this machine has, what it can run, and how fast it should be."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..formats import get_codec
from ..hw import cpu_info
from ..kernels.dispatch import isa_report
from ..models.shapes import SHAPES, get_shape

# Fraction of the measured read bandwidth the engine reaches on decode (docs/benchmarks.md);
# estimates use it so they promise what the benchmark shows, not the roofline. `bench moe` of a
# Qwen3-30B-A3B layer at 1 token on 2 vCPUs of an Intel Xeon with AMX: int4 57%, int8 68%, bf16 76%
# of the read measured on 2 MiB pages (kernels/machine.py); the lowest, int4, decides.
DECODE_EFFICIENCY = 0.6


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="CPU features, selected kernel variant, measured bandwidth and FMA peak, and what fits",
        description=(
            "Reports the CPU (ISA flags, cores, NUMA nodes, caches), the engine's selected kernel variant, torch and "
            "its devices, then measures read bandwidth and fp32 FMA peak for a few seconds (cached; --remeasure to "
            "redo) and estimates decode tokens/s of a model shape per method."
        ),
        epilog=(
            "examples:\n  hetmoe doctor\n  hetmoe doctor --remeasure --tune\n"
            "  hetmoe doctor --model deepseek-v3 --threads 2 --json"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="qwen3-30b-a3b", help=f"model shape to estimate ({', '.join(SHAPES)})")
    p.add_argument("--threads", type=int, default=0, help="threads to measure with (default: all usable CPUs)")
    p.add_argument("--remeasure", action="store_true", help="ignore the cached measurement")
    p.add_argument(
        "--tune",
        action="store_true",
        help="measure the engine's fastest settings on this machine now (GEMV width, GEMV/GEMM switch per method; "
        "about a minute, cached; otherwise done on first use unless HETMOE_TUNE=0)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(run=run)


def _torch_report() -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"version": torch.__version__, "cuda": torch.cuda.is_available()}
    if out["cuda"]:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def _ram_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def estimate(model: str, read_gb_per_s: float) -> list[dict[str, Any]]:
    """Decode tokens/s per method for a model shape, from bytes read per token."""
    shape = get_shape(model)
    rows = []
    for method, params in (("bf16", {}), ("fp8", {}), ("int8", {}), ("int4", {"group_size": 32})):
        bits = get_codec(method, **params).bits_per_weight((shape.intermediate, shape.hidden))
        expert_bytes = shape.active_expert_params() * bits / 8
        dense_bytes = shape.dense_params * bits / 8
        total_experts_gb = shape.expert_params * shape.experts * shape.moe_layers * bits / 8 / 1e9
        per_token = (expert_bytes + dense_bytes) / (read_gb_per_s * 1e9 * DECODE_EFFICIENCY)
        rows.append(
            {
                "method": method,
                "bits_per_weight": round(bits, 3),
                "experts_gb": round(total_experts_gb, 1),
                "bytes_per_token_mb": round((expert_bytes + dense_bytes) / 1e6, 1),
                "decode_tokens_per_s": round(1.0 / per_token, 1) if per_token > 0 else 0.0,
            }
        )
    return rows


def report(model: str, threads: int, remeasure: bool, tune: bool = False) -> dict[str, Any]:
    info = cpu_info()
    isa = isa_report()
    out: dict[str, Any] = {"cpu": info.as_dict(), "engine": isa, "torch": _torch_report(), "ram_bytes": _ram_bytes()}
    if isa.get("available"):
        from ..kernels.machine import measure_machine

        out["measured"] = measure_machine(threads or None, refresh=remeasure)
        out["estimate"] = {"model": model, "rows": estimate(model, out["measured"]["read_gb_per_s"])}
        from ..runtime import tuning

        if threads:
            from ..kernels import set_num_threads

            set_num_threads(threads)
        out["tuning"] = tuning.tune() if tune else tuning.cached()
        if out["tuning"] is not None and tuning.choices() is not None:  # what a model load now runs with
            tuning.apply(out["tuning"])
            out["engine"] = isa_report()
    out["verdict"] = _verdict(out)
    return out


def _verdict(r: dict[str, Any]) -> list[str]:
    lines = []
    eng = r["engine"]
    if not eng.get("available"):
        lines.append(f"the compiled engine is unavailable: {eng.get('error')}")
        return lines
    best = eng["best"]
    lines.append(
        {
            "amx": "AMX tiles available: prefill runs on AMX-BF16, everything else on AVX-512.",
            "avx512": "AVX-512 with VNNI: every method runs with the avx512 kernels.",
            "avx2": "AVX2+FMA: every method runs with the avx2 kernels (no AVX-512 here).",
        }.get(best, "no supported vector ISA: the engine cannot run here")
    )
    if not r["torch"]["cuda"]:
        lines.append("no CUDA device: models run fully on the CPU (device='cpu').")
    ram = r["ram_bytes"] / 1e9
    for row in r.get("estimate", {}).get("rows", []):
        fits = "fits" if row["experts_gb"] < ram * 0.85 else "does NOT fit"
        lines.append(
            f"{r['estimate']['model']} {row['method']}: experts {row['experts_gb']} GB ({fits} in {ram:.0f} GB RAM), "
            f"~{row['decode_tokens_per_s']} tokens/s decode"
        )
    return lines


def _widths(widths: object) -> str:
    """The GEMVs' widths as the engine reports them (kernels.dispatch.int_vector_widths): "int4 512,
    int8 256 (decode) / 512 (prompt) bits wide"."""
    if not isinstance(widths, dict):
        return f"{widths} bits wide"
    parts = []
    for family, regimes in widths.items():
        if isinstance(regimes, dict) and len(set(regimes.values())) > 1:
            parts.append(f"{family} " + " / ".join(f"{bits} ({regime})" for regime, bits in regimes.items()))
        else:
            parts.append(f"{family} {next(iter(regimes.values())) if isinstance(regimes, dict) else regimes}")
    return ", ".join(parts) + " bits wide"


def _prefetches(hints: object) -> str:
    """Each GEMV family's weight prefetch (kernels.dispatch.weight_prefetches): "int4 t1, int8 none,
    bf16 none"; one hint where they agree."""
    if not isinstance(hints, dict):
        return str(hints)
    if len(set(hints.values())) == 1:
        return str(next(iter(hints.values())))
    return ", ".join(f"{family} {hint}" for family, hint in hints.items())


def _tokens(gemv_max: int) -> str:
    from ..runtime.engine_layout import GEMV_ALL_TOKENS

    return "all" if gemv_max >= GEMV_ALL_TOKENS else str(gemv_max)


def run(args: argparse.Namespace) -> int:
    r = report(args.model, args.threads, args.remeasure, args.tune)
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    cpu = r["cpu"]
    print(
        f"CPU      {cpu['model']} ({cpu['arch']}), {cpu['usable_cpus']} usable of {cpu['logical_cpus']} CPUs, "
        f"{cpu['numa_nodes']} NUMA node(s)"
    )
    print(f"ISA      {' '.join(cpu['flags']) or '-'}")
    print(f"caches   {', '.join(f'{k} {v}' for k, v in cpu['caches'].items()) or '-'}")
    eng = r["engine"]
    if eng.get("available"):
        int8_act = eng.get("activation_bits") == 8
        print(
            f"engine   best variant {eng['best']}, selected {eng['selected']}, "
            f"GEMVs {_widths(eng['int_vector_bits'])}, weight prefetch {_prefetches(eng['weight_prefetch'])}"
            + (", 4- to 6-bit GEMVs on int8 activations (HETMOE_ACTIVATION_BITS=8)" if int8_act else "")
        )
        pool = eng["pool"]
        if "error" in pool:
            print(f"pool     unusable: {pool['error']}")
        else:
            groups = len(pool["node_cpus"])
            how = {"single": "one group", "libnuma": f"{groups} NUMA nodes", "split": f"{groups} groups (HETMOE_NUMA)"}
            print(
                f"pool     {pool['threads']} threads, {how[pool['source']]}"
                + (", each streaming its own rows of every expert" if groups > 1 else "")
                + f" (libnuma {'loaded' if pool['libnuma'] else 'not found'})"
            )
    else:
        print(f"engine   unavailable: {eng['error']}")
    t = r["torch"]
    print(f"torch    {t['version']}, CUDA {'yes: ' + ', '.join(t.get('devices', [])) if t['cuda'] else 'no'}")
    print(f"RAM      {r['ram_bytes'] / 2**30:.1f} GiB")
    if "measured" in r:
        m = r["measured"]
        print(
            f"measured read bandwidth {m['read_gb_per_s']} GB/s, fp32 FMA peak {m['fma_gflop_per_s']} GFLOP/s "
            f"({m['threads']} threads, {m['isa']}, {m['measured_at']})"
        )
    if "tuning" in r:
        tr = r["tuning"]
        if tr is None:
            print("tuned    not yet: measured on first use (hetmoe doctor --tune measures now; HETMOE_TUNE=0 never)")
        else:
            switch = ", ".join(f"{m} {_tokens(v)}" for m, v in tr["gemv_max"].items())
            print(
                f"tuned    GEMVs {_widths(tr['int_vector_bits'])}, "
                f"weight prefetch {_prefetches(tr.get('weight_prefetch', '-'))}; "
                f"GEMV up to (tokens an expert): {switch} "
                f"({tr['isa']}, {tr['measured_at']}, {tr['seconds']} s)"
            )
    print("verdict:")
    for line in r["verdict"]:
        print(f"  - {line}")
    return 0
