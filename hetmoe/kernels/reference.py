"""The oracle: a pure-torch MoE forward with the engine's exact contract.

``x [T, H]`` (bf16 or fp32), ``topk_ids [T, k]`` int64 with -1 meaning skip, ``topk_weights
[T, k]`` fp32; experts given in full precision (dequantize a codec's tensors first):
``gate, up [E, I, H]``, ``down [E, H, I]``. Each selected expert computes
``down @ (silu(gate @ x) * (up @ x))`` and the results are summed with the routing weights.
Math is float64 so that the reference itself contributes no error worth measuring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_forward_reference(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [T, H]`` in ``x``'s dtype; experts with ``skip[e]`` true contribute nothing."""
    xd = x.double()
    y = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for e in topk_ids.unique().tolist():
        if e < 0 or (skip is not None and bool(skip[e])):
            continue
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        xe = xd[tokens]
        h = F.silu(xe @ gate[e].double().T) * (xe @ up[e].double().T)
        out = h @ down[e].double().T
        y.index_add_(0, tokens, out * topk_weights[tokens, slots].double().unsqueeze(1))
    return y.to(x.dtype)
