"""Data-parallel fine-tuning: the gradients and sums that make N ranks take one process's steps.

How a step stays the step one process takes on the whole batch (``train.py``):
- every rank draws the same global batch (the order depends on the seed and epoch only) and takes
  a contiguous slice of it (``Ranks.take``);
- its loss is the sum of its tokens' losses over the number of predicted tokens in the *global*
  batch, so the ranks' losses add up to the one-process mean;
- ``sum_gradients`` adds the ranks' gradients in one flat all-reduce, so every rank holds the
  one-process gradient and its optimizer takes the same step. That is DDP's reduction, done
  here by hand because a rank's routed experts may see no token of a step (DDP's reducer then
  waits for a gradient that never comes) and because a gradient that is ``None`` everywhere must
  stay ``None`` (AdamW skips such a parameter; a zero gradient would still move it).

The frozen experts are not communicated: each rank loads them into its own CPU engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..runtime.process_group import Ranks, collective


def sum_gradients(ranks: Ranks, params: Sequence[torch.Tensor]) -> None:
    """Adds every rank's ``.grad`` of ``params`` (same order everywhere) in place, in one all-reduce.

    A gradient that is ``None`` on every rank stays ``None``; one that is ``None`` on some ranks
    counts as zero there.
    """
    import torch.distributed as dist

    if not params:
        return
    device = params[0].device
    # One buffer: a presence count a parameter (exact in float32 up to 2**24 ranks), then the grads.
    present = torch.tensor([0.0 if p.grad is None else 1.0 for p in params], device=device)
    grads = [(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1).float() for p in params]
    buffer = torch.cat([present, *grads])
    with collective(ranks, "the gradient all-reduce"):
        dist.all_reduce(buffer)
    offset = len(params)
    for p, seen in zip(params, buffer[: len(params)].tolist(), strict=True):
        n = p.numel()
        p.grad = buffer[offset : offset + n].view_as(p).to(p.dtype).clone() if seen else None
        offset += n


def sum_values(ranks: Ranks, values: Sequence[float]) -> list[float]:
    """The ranks' ``values`` added elementwise (float64)."""
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64)
    with collective(ranks, "a sum over ranks"):
        dist.all_reduce(t)
    return t.tolist()


def broadcast_parameters(ranks: Ranks, params: Sequence[torch.Tensor]) -> None:
    """Rank 0's values of ``params`` on every rank (same order everywhere), in one broadcast."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    with collective(ranks, "the parameters' broadcast"):
        dist.broadcast(flat, src=0)
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
