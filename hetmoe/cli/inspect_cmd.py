"""``hetmoe inspect PATH``: what is in a checkpoint, tensor by tensor, and how it is stored."""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any

from ..checkpoint import group_weights, open_source
from ..checkpoint.detect import WeightEntry, dtype_name
from ..formats import FormatError, get_codec, snr_db

DEFAULT_SNR_METHODS = "fp8,int8,int4,mxfp4"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="list a checkpoint's tensors, their storage and detected method",
        description=(
            "List every tensor of a safetensors file, a sharded checkpoint directory (with "
            "model.safetensors.index.json) or a GGUF file: name, shape, stored dtype, the method hetmoe "
            "detects for the weight it belongs to (bf16, fp8, int4, gptq, mxfp4, gguf:q4_k, ...) and bytes. "
            "Only headers are read unless --snr is given."
        ),
        epilog="examples:\n  hetmoe inspect ./Qwen3-30B-A3B --match 'layers\\.0\\.'\n"
        "  hetmoe inspect model.gguf --json > tensors.json\n"
        "  hetmoe inspect ./model --snr --methods int8,int4 --match 'experts\\.0\\.'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", help="safetensors file, checkpoint directory, index.json, or .gguf file")
    p.add_argument("--match", metavar="REGEX", help="only tensors whose name matches this regular expression")
    p.add_argument(
        "--snr",
        action="store_true",
        help="for full-precision weights, quantize with each of --methods and report round-trip SNR (reads the data)",
    )
    p.add_argument("--methods", default=DEFAULT_SNR_METHODS, help=f"methods for --snr (default {DEFAULT_SNR_METHODS})")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.set_defaults(run=run)


def inspect_path(path: str, match: str | None = None, snr_methods: list[str] | None = None) -> dict[str, Any]:
    """The report ``hetmoe inspect`` prints, as data."""
    source = open_source(path)
    pattern = re.compile(match) if match else None
    entries = [e for e in group_weights(source) if pattern is None or pattern.search(e.prefix)]
    records = []
    for entry in entries:
        snr = _round_trip_snr(source, entry, snr_methods) if snr_methods else {}
        for suffix, info in entry.tensors.items():
            records.append(
                {
                    "name": info.name,
                    "shape": list(info.shape),
                    "dtype": dtype_name(info.dtype),
                    "method": entry.method,
                    "bytes": info.nbytes,
                    "weight": entry.prefix,
                    "params": entry.params,
                    **({"snr_db": snr} if snr and suffix == next(iter(entry.tensors)) else {}),
                }
            )
    totals: dict[str, int] = {}
    for entry in entries:
        key = entry.method or "other"
        totals[key] = totals.get(key, 0) + entry.nbytes
    return {"path": str(path), "tensors": records, "bytes_by_method": totals}


def _round_trip_snr(source: Any, entry: WeightEntry, methods: list[str]) -> dict[str, float | None]:
    if not entry.full_precision or len(entry.shape) < 2:
        return {}
    weight = source.get(next(iter(entry.tensors.values())).name).float()
    out: dict[str, float | None] = {}
    for method in methods:
        try:
            codec = get_codec(method)
            out[method] = round(snr_db(weight, codec.dequantize(codec.quantize(weight, entry.prefix))), 2)
        except FormatError:  # e.g. K not divisible by the method's group size
            out[method] = None
    return out


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_report(report: dict[str, Any], snr_methods: list[str] | None) -> str:
    rows = report["tensors"]
    width = min(72, max([len(r["name"]) for r in rows] + [4]))
    head = f"{'name':{width}s} {'shape':>20s} {'dtype':>8s} {'method':>12s} {'bytes':>10s}"
    if snr_methods:
        head += "".join(f" {m[:9]:>9s}" for m in snr_methods)
    lines = [f"{report['path']}", head]
    for r in rows:
        line = (
            f"{r['name'][-width:]:{width}s} {r['shape']!s:>20s} {r['dtype']:>8s} "
            f"{r['method'] or '-':>12s} {_human(r['bytes']):>10s}"
        )
        if snr_methods and "snr_db" in r:
            for m in snr_methods:
                v = r["snr_db"].get(m)
                line += f" {'n/a' if v is None else ('inf' if math.isinf(v) else f'{v:.2f}'):>9s}"
        lines.append(line)
    total = sum(report["bytes_by_method"].values())
    lines.append(
        f"{len(rows)} tensors, {_human(total)}: "
        + ", ".join(f"{m} {_human(b)}" for m, b in sorted(report["bytes_by_method"].items(), key=lambda kv: -kv[1]))
    )
    if snr_methods:
        lines.append("SNR columns: round-trip SNR in dB of each full-precision weight through that method")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.snr else None
    report = inspect_path(args.path, args.match, methods)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(format_report(report, methods))
    return 0
