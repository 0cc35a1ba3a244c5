"""``hetmoe bench model --arch``: one architecture's random model, hetmoe with no flags beside
llama.cpp on the same files, in one run, interleaved.

The model (arch_models.py: a released model's layer shape, a few layers) is written once as a bf16
safetensors directory. With llama.cpp's tools (``llama_bench``, and the converter and quantizer
build_llama_cpp.sh puts beside it), llama.cpp's own ``convert_hf_to_gguf.py`` makes its BF16 GGUF
and ``llama-quantize`` the Q4_0, Q4_K_M and Q8_0 files from it: the files a user downloads. All are
cached beside the directory.

Per round, for each file: hetmoe first (``load_model(FILE)`` with no flags, as ``hetmoe generate
FILE`` runs it; vs_llama.hetmoe_speeds), then llama-bench on the same file (on the BF16 GGUF for
the safetensors directory), so both see the machine in the same minutes; before each, every file
of the run is written back to disk and the other files leave the page cache (release_page_cache).
The medians over rounds are printed with the ratios and issue 18's targets beside them: decode
>= 1.5x on Q4_0 and Q4_K_M and >= 1.3x from the safetensors directory against llama.cpp's BF16;
prefill >= 1.2x llama.cpp's best of Q4_0 and Q4_K_M. Without llama.cpp only hetmoe on the directory
is measured, and no peer figure is printed.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.atomic import write_text_atomic
from ..hw import cpu_info
from .arch_models import ARCHS, ArchModel, build_arch_model
from .llama_cpp import convert_to_gguf, llama_bench, quantize_gguf, tools_dir
from .model_build import DEFAULT_CACHE
from .vs_llama import hetmoe_speeds

QUANTS = ("Q4_0", "Q4_K_M", "Q8_0")
SAFETENSORS = "bf16 dir"  # the row of the safetensors directory (llama.cpp: its BF16 GGUF)
DECODE_TARGET = {SAFETENSORS: 1.3, "Q4_0": 1.5, "Q4_K_M": 1.5}  # issue 18's must-show
PREFILL_TARGET = 1.2  # against llama.cpp's best prefill of PREFILL_PEERS
PREFILL_PEERS = ("Q4_0", "Q4_K_M")


@dataclass
class ArchBenchConfig:
    model: ArchModel
    threads: int = 2
    steps: int = 32
    prefill: tuple[int, ...] = (512,)
    rounds: int = 2
    cache_dir: Path = DEFAULT_CACHE
    seed: int = 0
    llama_bench: Path | None = None
    quants: tuple[str, ...] = QUANTS


def model_files(cfg: ArchBenchConfig, log: Callable[[str], None]) -> list[tuple[str, Path, Path | None]]:
    """``(label, what hetmoe loads, what llama-bench runs or None)``: the directory, then each quant."""
    directory = build_arch_model(cfg.model, cfg.cache_dir, cfg.seed, log)
    if cfg.llama_bench is None:
        return [(SAFETENSORS, directory, None)]
    tools = tools_dir(cfg.llama_bench)
    bf16 = directory.with_name(directory.name + "-BF16.gguf")
    if not bf16.exists():
        convert_to_gguf(tools, directory, bf16, log)
    files: list[tuple[str, Path, Path | None]] = [(SAFETENSORS, directory, bf16)]
    for q in cfg.quants:
        path = directory.with_name(f"{directory.name}-{q}.gguf")
        if not path.exists():
            quantize_gguf(tools, bf16, path, q, log)
        files.append((q, path, path))
    return files


def _files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]


def release_page_cache(keep: Path, files: list[tuple[str, Path, Path | None]]) -> None:
    """Drop every file of the run but ``keep``'s from the page cache (POSIX_FADV_DONTNEED; clean
    pages, no root needed). Both programs use their weights from the mapped file where they can, and
    a bf16 model with its BF16 GGUF can exceed the RAM (GLM-4.5-Air's 4 layers: 2 x 14.5 GB): the
    file measured before would otherwise push out pages of the one measured now, rarely-routed
    experts' first, to be read from disk inside the timed steps. Each program gets the RAM it would
    have alone. Every file of the run, ``keep``'s included, is first written back (fsync): the files
    the run has just built and converted are dirty pages, which DONTNEED leaves, and whose writeback
    would otherwise take the disk and a core inside the first round's timed steps."""
    if not hasattr(os, "posix_fadvise"):
        return
    paths = {p for _, ours, theirs in files for p in (ours, theirs) if p is not None}
    kept = set(_files_of(keep))
    for f in sorted({f for p in paths for f in _files_of(p)}):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if f not in kept:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_arch_bench(cfg: ArchBenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    files = model_files(cfg, log)
    records: list[dict[str, Any]] = []
    for r in range(cfg.rounds):
        for label, ours, theirs in files:
            rec: dict[str, Any] = {"round": r, "label": label, "file": str(ours)}
            release_page_cache(ours, files)
            rec["hetmoe"] = hetmoe_speeds(ours, cfg.threads, cfg.steps, cfg.prefill)
            if theirs is not None and cfg.llama_bench is not None:
                rec["llama_file"] = str(theirs)
                release_page_cache(theirs, files)
                rec["llama_cpp"] = llama_bench(cfg.llama_bench, theirs, cfg.threads, cfg.steps, cfg.prefill)
            records.append(rec)
            log(format_record(rec))
    arch = ARCHS[cfg.model.arch]
    return {
        "machine": cpu_info().summary(),
        "arch": cfg.model.arch,
        "shape_of": arch.model,
        "model": asdict(cfg.model),
        "experts": cfg.model.expert_count,
        "config": {k: v for k, v in asdict(cfg).items() if k != "model"},
        "records": records,
        "medians": medians(records, cfg.prefill),
    }


def _kinds(prefill: tuple[int, ...]) -> list[str]:
    return ["decode", *(f"prefill {n}" for n in prefill)]


def medians(records: list[dict[str, Any]], prefill: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """Per file label: the median tokens/s of each program and kind over rounds, and the ratios."""
    out: dict[str, dict[str, Any]] = {}
    for label in dict.fromkeys(r["label"] for r in records):
        rows = [r for r in records if r["label"] == label]
        entry: dict[str, Any] = {}
        for kind in _kinds(prefill):
            entry[kind] = {"hetmoe": statistics.median(r["hetmoe"][kind] for r in rows)}
            if all("llama_cpp" in r for r in rows):
                entry[kind]["llama_cpp"] = statistics.median(r["llama_cpp"][kind] for r in rows)
                entry[kind]["ratio"] = entry[kind]["hetmoe"] / entry[kind]["llama_cpp"]
        entry["notes"] = rows[0]["hetmoe"]["notes"]
        out[label] = entry
    for n in prefill:  # prefill against llama.cpp's best of Q4_0 and Q4_K_M
        kind = f"prefill {n}"
        peers = [out[q][kind].get("llama_cpp") for q in PREFILL_PEERS if q in out]
        if peers and None not in peers:
            best = max(peers)
            for entry in out.values():
                entry[kind]["vs_best_llama_4bit"] = entry[kind]["hetmoe"] / best
    return out


def format_record(r: dict[str, Any]) -> str:
    h, ll = r["hetmoe"], r.get("llama_cpp")
    parts = [f"round {r['round']} {r['label']:8s}"]
    for kind in [k for k in h if k == "decode" or k.startswith("prefill")]:
        peer = f" / llama.cpp {ll[kind]:.1f} = {h[kind] / ll[kind]:.2f}x" if ll else ""
        parts.append(f"{kind} {h[kind]:.1f}{peer}")
    return "  ".join(parts) + f"  (load {h['load_s']:.1f} s)"


def format_table(result: dict[str, Any]) -> str:
    prefill = tuple(result["config"]["prefill"])
    lines = [
        f"{result['arch']} at the layer shape of {result['shape_of']}, {result['model']['layers']} layers, "
        f"{result['experts']} experts, vocabulary {result['model']['vocab']}; {result['machine']}",
        f"medians over {result['config']['rounds']} rounds, {result['config']['threads']} threads, tokens/s "
        "(hetmoe with no flags / llama.cpp = ratio; target per issue 18)",
    ]
    for label, entry in result["medians"].items():
        cells = []
        for kind in _kinds(prefill):
            e = entry[kind]
            if "ratio" in e:
                target = DECODE_TARGET.get(label) if kind == "decode" else None
                goal = f" (target {target}x)" if target else ""
                cells.append(f"{kind} {e['hetmoe']:.1f} / {e['llama_cpp']:.1f} = {e['ratio']:.2f}x{goal}")
            else:
                cells.append(f"{kind} {e['hetmoe']:.1f}")
            if "vs_best_llama_4bit" in e:
                cells.append(f"{e['vs_best_llama_4bit']:.2f}x llama.cpp's best 4-bit (target {PREFILL_TARGET}x)")
        lines.append(f"  {label:8s} " + "; ".join(cells))
        if entry["notes"]:
            lines.append(f"  {'':8s} hetmoe: {'; '.join(entry['notes'])}")
    if not any("llama_cpp" in r for r in result["records"]):
        lines.append("  (no llama.cpp figures: --llama-bench DIR/bin/llama-bench builds the GGUF files and runs it)")
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    write_text_atomic(Path(path), json.dumps(result, indent=1, default=str) + "\n")
