"""The oracle: a pure-torch MoE forward with the engine's exact contract.

``x [T, H]`` (bf16 or fp32), ``topk_ids [T, k]`` int64 with -1 meaning skip, ``topk_weights
[T, k]`` fp32; experts given in full precision (dequantize a codec's tensors first):
``gate, up [E, I, H]``, ``down [E, H, I]``. Each selected expert computes
``down @ act(gate @ x + gate_bias, up @ x + up_bias) + down_bias`` and the results are summed with
the routing weights; ``act`` is ``silu(g) * u`` or gpt-oss's clamped SwiGLU
(``g = min(g, limit)``, ``u = clamp(u, -limit, limit)``, ``(u + 1) * g * sigmoid(alpha * g)``).
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
    *,
    activation: str = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y [T, H]`` in ``x``'s dtype; experts with ``skip[e]`` true contribute nothing."""
    xd = x.double()
    y = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float64)
    for e in topk_ids.unique().tolist():
        if e < 0 or (skip is not None and bool(skip[e])):
            continue
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        xe = xd[tokens]
        g = xe @ gate[e].double().T
        u = xe @ up[e].double().T
        if gate_bias is not None:
            g = g + gate_bias[e].double()
        if up_bias is not None:
            u = u + up_bias[e].double()
        if activation == "silu":
            h = F.silu(g) * u
        elif activation == "swiglu-oai":
            g = g.clamp(max=limit)
            u = u.clamp(-limit, limit)
            h = (u + 1) * g * torch.sigmoid(alpha * g)
        else:
            raise ValueError(f"activation: expected 'silu' or 'swiglu-oai', found {activation!r}")
        out = h @ down[e].double().T
        if down_bias is not None:
            out = out + down_bias[e].double()
        y.index_add_(0, tokens, out * topk_weights[tokens, slots].double().unsqueeze(1))
    return y.to(x.dtype)
