"""A batch-invariant attention for decode steps over a left-padded batch.

With transformers' own SDPA attention, a decode step over a left-padded batch is mathematically
the same as each request's unbatched step, but not bit for bit: the padding mask sends grouped-query
attention down another kernel path (``pack_gqa`` instead of ``enable_gqa``) over a longer key
length, and in bf16 the rounding differences flip a greedy token now and then. A request's output
would then depend on what else happened to be running.

``ragged_sdpa`` removes that: for a one-token query with a left-padding mask it runs the model's
attention function (``hetmoe.models.cpu_attention.attention_forward``: hetmoe's fp32 decode
attention on the CPU, transformers' ``sdpa_attention_forward`` elsewhere) once per row on that row's
own keys and values (the padding sliced off, no mask), which is exactly the call an unbatched decode
step makes. Everything else (prefill, no mask, any other mask shape) goes to that function
unchanged. The projections and the MoE experts around the attention are per-row computations and
were checked to be bit-identical whatever the batch (tests/test_serve_batching.py). The cost is one
small attention call per running request and layer.

It is registered with transformers under ``ATTENTION_NAME`` (with the SDPA mask builder) and
enabled per model by :func:`use_ragged_attention`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..models.cpu_attention import ATTENTION_NAME as CPU_ATTENTION_NAME
from ..models.cpu_attention import attention_forward, switch_attention

ATTENTION_NAME = "hetmoe_ragged_sdpa"


def ragged_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    starts = _left_padding(attention_mask, query, key)
    if starts is None:
        return attention_forward(module, query, key, value, attention_mask, **kwargs)
    rows = []
    for i, start in enumerate(starts):
        out, _ = attention_forward(
            module, query[i : i + 1], key[i : i + 1, :, start:], value[i : i + 1, :, start:], None, **kwargs
        )
        rows.append(out)
    return torch.cat(rows, dim=0), None


def _left_padding(mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor) -> list[int] | None:
    """Per row, where its real keys start, when ``mask`` is a one-token query's left-padding mask; else None."""
    if mask is None or mask.dtype != torch.bool or query.shape[2] != 1 or mask.dim() != 4 or mask.shape[2] != 1:
        return None
    if mask.shape[0] != query.shape[0] or mask.shape[-1] != key.shape[2]:
        return None
    valid = mask[:, 0, 0, :]
    length = valid.shape[-1]
    counts = valid.sum(-1)
    starts = length - counts
    # Left padding only: each row's valid keys are exactly the columns from its start on.
    expected = torch.arange(length, device=valid.device)[None, :] >= starts[:, None]
    if bool((counts == 0).any()) or not torch.equal(valid, expected):
        return None
    return [int(s) for s in starts.tolist()]


def use_ragged_attention(model: Any) -> bool:
    """Switch a model on SDPA (or hetmoe's CPU attention) to the ragged one; False if it uses another."""
    return switch_attention(model, ATTENTION_NAME, ragged_sdpa, ("sdpa", CPU_ATTENTION_NAME))
