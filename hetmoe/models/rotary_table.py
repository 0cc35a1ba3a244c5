"""A decode step's rotary cos/sin, sliced from a table the model's own rotary module made.

transformers' rotary embedding module computes cos and sin afresh for every forward: a product,
a concatenation, cos, sin, two scalings and two casts, ~75 us of dispatch a decode step on a CPU for
a few hundred values. Every one of those operations is elementwise in the position, so the module
called once on 256 positions gives each position's rows exactly as a call on that position alone
would (a test compares them bit for bit). ``rotary_at`` keeps such a block on the module and slices
a step's row from it, making the next block when the position leaves this one. Rope types that
change their frequencies with the sequence length (dynamic NTK, longrope) are called directly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TABLE_POSITIONS = 256


def _static(rotary: nn.Module) -> bool:
    """The module's frequencies do not depend on the positions it is asked for."""
    kind = getattr(rotary, "rope_type", "default")
    return isinstance(kind, str) and "dynamic" not in kind and kind != "longrope"


def rotary_at(rotary: nn.Module, x: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary(x, position_ids=[[position]])``: ``(cos, sin)`` each ``[1, 1, D]`` of x's dtype."""
    inv_freq = getattr(rotary, "inv_freq", None)
    tabled = _static(rotary) and isinstance(inv_freq, torch.Tensor) and rotary.__dict__.get("_hetmoe_tabled", True)
    if not tabled or rotary._forward_hooks or rotary._forward_pre_hooks:
        return rotary(x, position_ids=torch.tensor([[position]], device=x.device))
    start = position - position % TABLE_POSITIONS
    # what the table was made from: a new dtype, device or frequencies (written in place or replaced)
    version = -1 if inv_freq.is_inference() else inv_freq._version
    key = (x.dtype, x.device, inv_freq.data_ptr(), version, getattr(rotary, "attention_scaling", None))
    table: Any = rotary.__dict__.get("_hetmoe_rotary_table")
    if table is None or table[0] != key or table[1] != start:
        positions = torch.arange(start, start + TABLE_POSITIONS, device=x.device).unsqueeze(0)
        made = rotary(x, position_ids=positions)
        if not _rows_by_position(made):  # not (cos, sin) [1, positions, D] (DeepSeek-V2's complex rows)
            rotary._hetmoe_tabled = False
            return rotary(x, position_ids=torch.tensor([[position]], device=x.device))
        table = (key, start, *made)
        rotary._hetmoe_rotary_table = table
    i = position - start
    return table[2][:, i : i + 1], table[3][:, i : i + 1]


def _rows_by_position(made: Any) -> bool:
    return (
        isinstance(made, tuple)
        and len(made) == 2
        and all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[:2] == (1, TABLE_POSITIONS) for t in made)
    )
