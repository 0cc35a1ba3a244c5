"""Expert-parallel decode beside one process, on this machine's loopback.

The model: the Qwen3-30B-A3B-shaped 4-layer model (``hetmoe bench model``'s default shape: 128
experts of 768, top-8, hidden 2048) as a pure-Q4_0 GGUF, written once into --cache (or --model).
Per round, alternating, each in its own processes:

- one process, every CPU (``load_model(MODEL)``);
- ``torchrun --nproc-per-node 2``: ``load_model(MODEL, expert_parallel=2)``, each rank pinned to
  half the CPUs, rank 0 holding half of each layer's experts and the rest of the model;
- the transport alone: the message out (header and row) and the partial sum back that a decode step
  exchanges with a rank for one MoE layer, with no compute (the link's own cost).

Decode: a 32-token prompt, then --steps greedy single-token forwards; the median step. For the
expert-parallel run, per MoE layer and step: the dispatch (packing and posting the rows out), the
collect (rank 0 waiting for the partial sums after its own share: the other rank's compute beyond
rank 0's, and the messages' flight) and the bytes each way.

    python bench/bench_expert_parallel.py --rounds 3 --json docs/bench-expert-parallel-zen4.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROLE_ENV = "HETMOE_BENCH_EP_ROLE"


def _decode(model: torch.nn.Module, steps: int, vocab: int) -> list[float]:
    from hetmoe.bench.model import decode_steps
    from hetmoe.runtime.expert_parallel import RemoteExperts, TransferStats
    from hetmoe.runtime.kv_cache import growing_cache

    gen = torch.Generator().manual_seed(0)
    cache = growing_cache(model.config)
    with torch.no_grad():
        out = model(torch.randint(0, vocab, (1, 32), generator=gen), cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        for hybrid in model.hetmoe.layers.values():  # the decode steps' transfers only, not the prompt's
            if isinstance(hybrid.cpu, RemoteExperts):
                hybrid.cpu.transfer = TransferStats()
        return decode_steps(model, cache, token, steps)


def _role_decode(model_path: str, steps: int, out: str, parallel: int | None) -> None:
    import hetmoe

    torch.set_num_threads(1)  # as hetmoe generate runs a CPU-only model: torch's small ops on one thread
    from hetmoe.gc_pause import freeze_for_decoding

    model = hetmoe.load_model(model_path, expert_parallel=parallel)  # expert ranks stay inside
    freeze_for_decoding()  # as hetmoe generate and serve do after their load
    times = _decode(model, steps, int(model.config.vocab_size))
    result: dict = {"step_ms": statistics.median(times[2:]) * 1e3, "steps": steps}
    if parallel:
        layers = {}
        for layer, hybrid in sorted(model.hetmoe.layers.items()):
            t = hybrid.cpu.transfer
            layers[layer] = {
                "calls": t.calls,
                "dispatch_us": t.dispatch_s / t.calls * 1e6,
                "collect_us": t.collect_s / t.calls * 1e6,
                "bytes_out_per_call": t.bytes_sent / t.calls,
                "bytes_back_per_call": t.bytes_received / t.calls,
            }
        result["layers"] = layers
    Path(out).write_text(json.dumps(result))


def _role_transport(hidden: int, top_k: int, repeats: int, out: str) -> None:
    """One decode token's exchange for one MoE layer, as RemoteExperts sends it, ``repeats`` times,
    no compute: one message out (header and the row), one back (the partial sum)."""
    import torch.distributed as dist

    from hetmoe.runtime.expert_parallel import _first_size

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first, back = torch.zeros(_first_size(hidden, top_k)), torch.zeros(hidden)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(first, 1)
            dist.recv(back, 1)
        else:
            dist.recv(first, 0)
            dist.send(back, 0)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"exchange_us": statistics.median(times[10:]) * 1e6}))
    dist.destroy_process_group()


def _run(command: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{done.stderr[-3000:]}")


def main() -> None:
    role = os.environ.get(ROLE_ENV)
    if role == "decode":
        _role_decode(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) or None)
        return
    if role == "transport":
        _role_transport(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model file or directory (default: the Q4_0 GGUF written into --cache)")
    p.add_argument("--cache", default=os.path.expanduser("~/.cache/hetmoe/bench"), help="where that model is written")
    p.add_argument("--steps", type=int, default=32, help="decode steps a run (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each one process then two (default 3)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()

    from hetmoe.bench.model_build import ModelShape
    from hetmoe.bench.model_write import build_source

    shape = ModelShape()
    model = args.model or str(build_source(shape, "q4_0-gguf", args.cache))
    here = str(Path(__file__).resolve())
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", here]
    out = Path(args.cache) / "ep-run.json"
    rounds = []
    for r in range(args.rounds):
        one_env = env | {ROLE_ENV: "decode"}
        _run([sys.executable, here, model, str(args.steps), str(out), "0"], one_env)
        one = json.loads(out.read_text())
        _run([*torchrun, model, str(args.steps), str(out), "2"], one_env)
        two = json.loads(out.read_text())
        _run([*torchrun, str(shape.hidden), str(shape.top_k), "2000", str(out)], env | {ROLE_ENV: "transport"})
        wire = json.loads(out.read_text())
        rounds.append({"one_process": one, "expert_parallel_2": two, "transport": wire})
        layers = two["layers"].values()
        print(
            f"round {r + 1}: one process {1e3 / one['step_ms']:.1f} tokens/s ({one['step_ms']:.2f} ms), "
            f"2 processes {1e3 / two['step_ms']:.1f} tokens/s ({two['step_ms']:.2f} ms); a MoE layer's "
            f"dispatch {statistics.mean(x['dispatch_us'] for x in layers):.0f} us, collect "
            f"{statistics.mean(x['collect_us'] for x in layers):.0f} us; the exchange alone "
            f"{wire['exchange_us']:.0f} us",
            flush=True,
        )
    out.unlink(missing_ok=True)
    ones = [x["one_process"]["step_ms"] for x in rounds]
    twos = [x["expert_parallel_2"]["step_ms"] for x in rounds]
    print(
        f"median: one process {1e3 / statistics.median(ones):.1f} tokens/s, 2 processes "
        f"{1e3 / statistics.median(twos):.1f} tokens/s ({statistics.median(ones) / statistics.median(twos):.2f}x)"
    )
    if args.json:
        doc = {"model": model, "shape": shape.name, "cpus": len(os.sched_getaffinity(0)), "rounds": rounds}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
