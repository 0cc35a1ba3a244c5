"""hetmoe with no flags beside llama.cpp's llama-bench on the same files, in one run, interleaved.

    python bench/bench_vs_llama.py --llama-bench DIR/bin/llama-bench m-Q4_0.gguf m-Q4_K_M.gguf \\
        MODEL_DIR=m-bf16.gguf --threads 2 --rounds 2

Each FILE is a GGUF (both programs run it) or ``DIR=GGUF``: hetmoe loads the safetensors directory,
llama.cpp the GGUF made from it (e.g. its BF16 conversion). Per round and file, hetmoe runs first
(``load_model(FILE)`` with its defaults, as ``hetmoe generate FILE`` does), then llama-bench, so
both see the machine in the same minutes. Measured, for both:

- decode: tokens/s of ``--steps`` greedy one-token steps. llama-bench's ``tg`` test starts from an
  empty cache; hetmoe's steps follow a 1-token prompt, the same contexts.
- prefill: tokens/s of a ``--prefill``-token prompt into an empty cache, logits of the last token
  only (llama-bench's ``pp`` test computes no others).

Prints one row per file and round with the ratios hetmoe / llama.cpp, then the medians; ``--json``
writes every number. Nothing is printed that this run did not measure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from hetmoe.bench.llama_cpp import llama_bench
from hetmoe.bench.vs_llama import hetmoe_speeds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="GGUF files, or DIR=GGUF pairs")
    p.add_argument("--llama-bench", required=True, type=Path, help="llama.cpp's llama-bench binary")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=64, help="decode steps (llama-bench -n)")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens (llama-bench -p)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args()
    if not args.llama_bench.is_file():
        build = "../shared/peers/build_llama_cpp.sh"
        raise SystemExit(f"--llama-bench {args.llama_bench}: no such file (build it: {build})")
    pairs = []
    for spec in args.files:
        ours, _, theirs = spec.partition("=")
        pairs.append((Path(ours), Path(theirs or ours)))
        for f in pairs[-1]:
            if not f.exists():
                raise SystemExit(f"{f}: no such file or directory")
    records: list[dict[str, Any]] = []
    print(f"{'file':34s} {'round':>5s} {'decode t/s':>21s} {'x':>6s} {'prefill t/s':>21s} {'x':>6s}")
    print(f"{'':34s} {'':5s} {'hetmoe':>10s} {'llama.cpp':>10s} {'':6s} {'hetmoe':>10s} {'llama.cpp':>10s}")
    for r in range(args.rounds):
        for ours, theirs in pairs:
            h = hetmoe_speeds(ours, args.threads, args.steps, (args.prefill,))
            ll = llama_bench(args.llama_bench, theirs, args.threads, args.steps, (args.prefill,))
            h["prefill"], ll["prefill"] = h[f"prefill {args.prefill}"], ll[f"prefill {args.prefill}"]
            rec = {"file": str(ours), "llama_file": str(theirs), "round": r, "hetmoe": h, "llama_cpp": ll}
            records.append(rec)
            decode = f"{h['decode']:10.1f} {ll['decode']:10.1f} {h['decode'] / ll['decode']:6.2f}"
            prefill = f"{h['prefill']:10.1f} {ll['prefill']:10.1f} {h['prefill'] / ll['prefill']:6.2f}"
            print(f"{ours.name[:34]:34s} {r:5d} {decode} {prefill}", flush=True)
    print("medians over rounds:")
    for ours, _ in pairs:
        rs = [x for x in records if x["file"] == str(ours)]
        for kind in ("decode", "prefill"):
            ratio = statistics.median(x["hetmoe"][kind] / x["llama_cpp"][kind] for x in rs)
            print(f"  {ours.name}: {kind} hetmoe / llama.cpp = {ratio:.2f}")
        print(f"  {ours.name}: hetmoe notes: {rs[0]['hetmoe']['notes']}")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "records": records}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
