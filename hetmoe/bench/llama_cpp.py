"""llama.cpp's ``llama-bench``, run on a GGUF file in this process's run: what a benchmark prints
beside hetmoe's figures (never figures stored from another run)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path


def llama_bench(
    binary: str | Path, gguf: str | Path, threads: int, steps: int, prompts: tuple[int, ...]
) -> dict[str, float]:
    """``{"decode": tok/s, "prefill N": tok/s ...}`` of ``llama-bench -m GGUF -t THREADS -p N,.. -n STEPS``:
    decode from an empty cache, each prompt into an empty cache (its last logits only).

    llama.cpp at its best: its weight repacking (``--repack``, on by default) is run both ways and
    each test keeps the faster (on an AMD Zen 4 repacking made Q4_0 faster and Q4_K_M's prefill half
    as fast). Where the repacked run fails (on CPUs with AMX llama.cpp's AMX repack dies with SIGILL,
    ../shared/peers/README.md), ``--repack 0`` alone. A failed run is a ValueError naming the file and
    the end of llama-bench's own message."""
    binary, gguf = Path(binary), Path(gguf)
    if not binary.is_file():
        raise ValueError(f"{binary}: no llama-bench binary there (../shared/peers/build_llama_cpp.sh builds one)")
    if not gguf.is_file():
        raise ValueError(f"{gguf}: no such GGUF file")
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-n", str(steps), "-r", "1"]
    cmd += ["-p", ",".join(str(p) for p in prompts), "-o", "json"]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = f"{binary.parent}:{env.get('LD_LIBRARY_PATH', '')}"  # its shared libraries
    out = subprocess.run([*cmd, "--repack", "0,1"], capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        out = subprocess.run([*cmd, "--repack", "0"], capture_output=True, text=True, check=False, env=env)
    if out.returncode != 0:
        raise ValueError(f"llama-bench on {gguf} exited {out.returncode}: {out.stderr.strip()[-300:]}")
    speeds: dict[str, float] = {}
    for run in json.loads(out.stdout):
        key = "decode" if run["n_gen"] else f"prefill {run['n_prompt']}"
        speeds[key] = max(speeds.get(key, 0.0), float(run["avg_ts"]))
    return speeds
