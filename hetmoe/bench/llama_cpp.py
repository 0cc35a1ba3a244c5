"""llama.cpp's tools, run by the benchmarks in their own run: ``llama-bench`` on a GGUF file (what a
benchmark prints beside hetmoe's figures, never figures stored from another run), and its converter
and ``llama-quantize``, which make the GGUF files a user downloads from a safetensors directory.

The tools are those ../shared/peers/build_llama_cpp.sh lays out in DIR: ``DIR/bin/llama-bench``,
``DIR/bin/llama-quantize`` (with ggml's shared libraries beside them), ``DIR/convert_hf_to_gguf.py``
with ``DIR/gguf-py`` (and ``DIR/conversion`` in recent versions).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .. import user_environment
from ..checkpoint.atomic import atomic_path

BUILD_SCRIPT = "../shared/peers/build_llama_cpp.sh"


def _env(binary: Path) -> dict[str, str]:
    """llama.cpp's tools run in the user's environment (not with what hetmoe set in its own process:
    hetmoe.user_environment) with ggml's shared libraries found beside the binary."""
    env = user_environment()
    env["LD_LIBRARY_PATH"] = f"{binary.parent}:{env.get('LD_LIBRARY_PATH', '')}"  # ggml's shared libraries
    return env


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
    env = _env(binary)
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


def tools_dir(llama_bench_binary: Path) -> Path:
    """The directory build_llama_cpp.sh filled, from its ``bin/llama-bench``; a ValueError naming what
    is missing when the converter or llama-quantize is not beside it."""
    root = Path(llama_bench_binary).resolve().parent.parent
    for need in (root / "bin" / "llama-quantize", root / "convert_hf_to_gguf.py", root / "gguf-py"):
        if not need.exists():
            raise ValueError(
                f"{need}: not there; {BUILD_SCRIPT} DIR puts llama.cpp's converter and quantizer "
                "beside DIR/bin/llama-bench"
            )
    return root


# The converter picks the pre-tokenizer by hashing how the tokenizer splits a test text and refuses
# hashes it does not list. The tokenizers hetmoe's benchmark models carry (arch_models.write_tokenizer)
# split with GPT-2's regex, so that is the pre-tokenizer it is told; the tensors are converted by
# llama.cpp's own code, unchanged.
_CONVERT = """
import sys
from pathlib import Path
root = Path(sys.argv[1])
sys.path[:0] = [str(root), str(root / "gguf-py")]
import convert_hf_to_gguf as converter
try:
    from conversion.base import TextModel
except ImportError:  # before the converter was split into a package
    TextModel = converter.TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
converter.main()
"""


def convert_to_gguf(tools: Path, model_dir: Path, out: Path, log: Callable[[str], None] = print) -> Path:
    """``out``: ``model_dir`` (a benchmark model, GPT-2-split tokenizer) as a BF16 GGUF by llama.cpp's
    converter, written atomically; a ValueError with the end of the converter's message if it fails."""
    log(f"converting {model_dir.name} to {out.name} with llama.cpp's convert_hf_to_gguf.py")
    with atomic_path(out) as tmp:
        cmd = [sys.executable, "-c", _CONVERT, str(tools), str(model_dir), "--outtype", "bf16", "--outfile", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            tail = done.stderr.strip()[-400:]
            raise ValueError(f"convert_hf_to_gguf.py on {model_dir} exited {done.returncode}: {tail}")
    return out


def quantize_gguf(tools: Path, source: Path, out: Path, qtype: str, log: Callable[[str], None] = print) -> Path:
    """``out``: ``source`` quantized to ``qtype`` (Q4_0, Q4_K_M, Q8_0 ...) by ``llama-quantize``,
    written atomically; a ValueError with the end of its message if it fails."""
    binary = tools / "bin" / "llama-quantize"
    log(f"quantizing {source.name} to {qtype} with llama-quantize")
    with atomic_path(out) as tmp:
        cmd = [str(binary), str(source), str(tmp), qtype]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=_env(binary))
        if done.returncode != 0:
            raise ValueError(f"llama-quantize {source} {qtype} exited {done.returncode}: {done.stderr.strip()[-400:]}")
    return out
