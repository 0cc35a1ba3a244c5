"""One rank of an expert-parallel greedy decode, started by tests/test_expert_parallel.py under
torchrun: every rank calls ``load_model(MODEL, expert_parallel=WORLD)`` alike; rank 0 decodes
``STEPS`` greedy tokens after a fixed prompt and writes them to OUT (JSON); the other ranks serve
their experts inside ``load_model`` and leave when rank 0's process ends."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import hetmoe

PROMPT = [[3, 17, 42, 7, 99, 5, 12, 64]]


def greedy(model, steps: int) -> list[int]:
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    return out[0, ids.shape[1] :].tolist()


def main() -> None:
    model_dir, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    placement = sys.argv[4] if len(sys.argv) > 4 else "id"
    stats = sys.argv[5] if len(sys.argv) > 5 else None
    world = int(os.environ["WORLD_SIZE"])
    model = hetmoe.load_model(
        model_dir, dtype="float32", expert_parallel=world, expert_placement=placement, routing_stats=stats
    )
    tokens = greedy(model, steps)  # rank 0 only: the others never return from load_model
    out.write_text(json.dumps({"tokens": tokens, "notes": model.hetmoe.notes}))


if __name__ == "__main__":
    main()
