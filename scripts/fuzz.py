#!/usr/bin/env python
"""Fuzz hetmoe's readers for as long as asked (tests/fuzzing.py holds the harnesses).

    .venv/bin/python scripts/fuzz.py                          # every target, 100,000 cases each
    .venv/bin/python scripts/fuzz.py --targets gguf,config --seconds 600
    .venv/bin/python scripts/fuzz.py --cases 1000000 --seed 7 --save fuzz-failures/

Targets: safetensors (the header reader), gguf (header, metadata, tensor infos, through the
checkpoint reader), config (config.json and its quantization_config, over the tiny checkpoints),
manifest (the expert store's manifest.json), chat (fine-tuning JSONL). Each runs in a child process,
so a crash of the interpreter is reported with the case that caused it (left in the work directory).
A failing case's bytes and traceback are saved under --save. Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ALL = ("safetensors", "gguf", "config", "manifest", "chat")


def child(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    import fuzzing
    from tiny_models import TinyCache

    work = Path(args.work)
    cache = TinyCache(work / "tiny")
    cache.root.mkdir(parents=True, exist_ok=True)
    target = fuzzing.build_targets(cache, work / "seeds")[args.child]()
    report = fuzzing.fuzz(
        target,
        work,
        cases=args.cases,
        seconds=args.seconds,
        seed=args.seed,
        save=Path(args.save) if args.save else None,
    )
    print(report.line(), flush=True)
    for f in report.failures[:10]:
        print(f"  {f.kind} at case {f.case}: {f.message[:300]}" + (f" (saved: {f.saved})" if f.saved else ""))
    return 1 if report.failures else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(ALL), help=f"comma-separated, of {', '.join(ALL)}")
    ap.add_argument("--cases", type=int, default=None, help="cases per target (default 100000 unless --seconds)")
    ap.add_argument("--seconds", type=float, default=None, help="time per target")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--save", default=None, help="directory for failing cases")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cases is None and args.seconds is None:
        args.cases = 100_000
    if args.child:
        return child(args)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(ALL))
    if unknown:
        ap.error(f"unknown targets {unknown}; known: {', '.join(ALL)}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    status = 0
    with tempfile.TemporaryDirectory(prefix="hetmoe-fuzz-") as tmp:
        for t in targets:
            work = Path(args.work or tmp) / t
            cmd = [sys.executable, __file__, "--child", t, "--seed", str(args.seed), "--work", str(work)]
            cmd += ["--cases", str(args.cases)] if args.cases is not None else []
            cmd += ["--seconds", str(args.seconds)] if args.seconds is not None else []
            cmd += ["--save", args.save] if args.save else []
            rc = subprocess.run(cmd, env=env).returncode
            if rc < 0:
                kept = f"the case is in {work}/cases-{t}" if args.work else "rerun with --work DIR to keep the case"
                print(f"{t}: the interpreter died of signal {-rc}; {kept}", flush=True)
            status = status or (rc != 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
