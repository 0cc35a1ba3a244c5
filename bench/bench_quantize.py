"""Converting a bf16 model to 4 bits: hetmoe beside llama-quantize, on the same weights, interleaved.

    python bench/bench_quantize.py MODEL_DIR --gguf MODEL-bf16.gguf \\
        --llama-quantize DIR/bin/llama-quantize --rounds 2 --json out.json

Per round, each in its own process, one after another so all see the machine in the same minutes:

- ``read``: a plain read of the source's safetensors bytes (the floor for anything that reads them);
- ``llama-quantize``: ``llama-quantize GGUF OUT Q4_0 THREADS`` from the bf16 GGUF of the same model
  (with ``--gguf`` and ``--llama-quantize``);
- ``hetmoe convert``: ``hetmoe convert MODEL_DIR STORE --method int4`` (group 32), the store written;
- ``hetmoe load``: ``load_model(MODEL_DIR, method="int4")``, the experts quantized while loading (as
  ``hetmoe generate DIR --method int4`` does), with the process's peak RSS.

The page cache holds the sources after the first read (``--cold`` drops it before every step; that
needs root). Prints seconds, GB/s of source and the ratio to llama-quantize (else to the read);
nothing printed comes from anywhere but this run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hetmoe import user_environment
from hetmoe.bench.model import drop_page_cache, plain_read

_LOAD = """
import sys, time
from hetmoe import load_model
t = time.perf_counter()
load_model(sys.argv[1], method="int4", cpu_threads=int(sys.argv[2]), progress=False)
print(time.perf_counter() - t)
"""


def _run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(wall seconds, peak RSS GB, stdout) of one child process; its failure is this run's failure."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (ru_maxrss in KiB)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd[:4])} ...: exit {proc.returncode}\n{err.read()[-2000:]}")
        return wall, usage.ru_maxrss / 2**20, out.read()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a bf16 safetensors model directory")
    ap.add_argument("--gguf", type=Path, help="the same model as a bf16 GGUF, for llama-quantize")
    ap.add_argument("--llama-quantize", type=Path, help="llama.cpp's llama-quantize binary")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every step (root)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    files = sorted(args.model.glob("*.safetensors"))
    source_bytes = sum(f.stat().st_size for f in files)
    hetmoe = [sys.executable, "-c", "import sys; from hetmoe.cli.main import main; sys.exit(main())"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    lib = str(args.llama_quantize.parent) if args.llama_quantize else ""
    # llama-quantize in the user's environment, not with what importing hetmoe set (hetmoe.user_environment)
    user = user_environment()
    llama_env = {**user, "LD_LIBRARY_PATH": lib + ":" + user.get("LD_LIBRARY_PATH", "")}
    rows: dict[str, list[float]] = {}
    rss: list[float] = []
    with tempfile.TemporaryDirectory(dir=args.model.parent) as tmp:
        for r in range(args.rounds):
            steps = []
            if args.cold:
                drop_page_cache()
            steps.append(("read", plain_read(files, cold=False)))
            if args.llama_quantize and args.gguf:
                if args.cold:
                    drop_page_cache()
                out = Path(tmp) / "q4_0.gguf"
                cmd = [str(args.llama_quantize), str(args.gguf), str(out), "Q4_0", str(args.threads)]
                steps.append(("llama-quantize Q4_0", _run(cmd, llama_env)[0]))
                out.unlink()
            if args.cold:
                drop_page_cache()
            store = Path(tmp) / "store"
            cmd = [*hetmoe, "convert", str(args.model), str(store), "--method", "int4", "--quiet"]
            steps.append(("hetmoe convert int4", _run(cmd, env)[0]))
            shutil.rmtree(store)
            if args.cold:
                drop_page_cache()
            _, peak, out_text = _run([sys.executable, "-c", _LOAD, str(args.model), str(args.threads)], env)
            steps.append(("hetmoe load --method int4", float(out_text.strip().splitlines()[-1])))
            rss.append(peak)
            for name, seconds in steps:
                rows.setdefault(name, []).append(seconds)
                print(f"round {r}: {name:28s} {seconds:7.2f} s  {source_bytes / seconds / 1e9:5.2f} GB/s", flush=True)
    base = "llama-quantize Q4_0" if "llama-quantize Q4_0" in rows else "read"
    ref = statistics.median(rows[base])
    print(f"\nmedians ({source_bytes / 1e9:.2f} GB of bf16 safetensors, {args.threads} threads):")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"  {name:28s} {med:7.2f} s  {med / ref:5.2f}x {base}")
    print(f"  peak RSS of hetmoe load: {max(rss):.2f} GiB")
    if args.json:
        args.json.write_text(json.dumps({"source_bytes": source_bytes, "threads": args.threads, "cold": args.cold,
                                         "seconds": rows, "peak_rss_gb": rss}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
