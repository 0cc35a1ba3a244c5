"""The running requests' KV caches as one left-padded batch cache.

Why this shape: a decode step runs ONE forward over every running request, so their caches have
to be one ``[B, heads, L, dim]`` tensor per layer. Requests differ in length, so each row is
padded on the left to the longest, and a 2D attention mask marks the padding; each row's
``position_ids`` are its own token count, so rotary positions are the unbatched ones. The
per-step cost is what transformers' DynamicCache already pays (it appends one column per step);
the batch is rebuilt (one copy of the cache) only when membership changes: a request that
finished its prefill joins by padding itself or the batch on the left and concatenating rows, a
request that finished or was cancelled leaves by keeping the other rows, after which columns
that are padding in every row are dropped so the width follows the longest live request. A
request's prefill runs alone (its own DynamicCache, exactly as an unbatched ``generate`` does),
which keeps its first token independent of the batch.

Only caches whose layers are all plain ``DynamicLayer`` (full attention) can be padded this way;
:func:`batchable` says whether a model's cache is one of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def batchable(cache: Any) -> bool:
    """True when every layer of ``cache`` (a prefilled DynamicCache) is a full-attention DynamicLayer."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    return all(
        type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4
        for layer in layers
    )


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` ``[B, H, L, D]`` with ``n`` zero columns before L."""
    return F.pad(t, (0, 0, n, 0)) if n else t


class PaddedBatch:
    """Rows in the order they joined; ``cache`` is a DynamicCache the model's forward appends to."""

    def __init__(self) -> None:
        self.cache: Any = None
        self.mask: torch.Tensor | None = None  # [B, L] int64: 1 = a real token
        self.positions: torch.Tensor | None = None  # [B] int64: the position of each row's next token

    @property
    def size(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[0])

    @property
    def width(self) -> int:
        return 0 if self.mask is None else int(self.mask.shape[1])

    def clear(self) -> None:
        self.cache = self.mask = self.positions = None

    def add(self, cache: Any, length: int) -> None:
        """Append a prefilled single-request cache of ``length`` tokens as the last row."""
        if not batchable(cache):
            raise ValueError("only caches of full-attention DynamicLayers can join a padded batch")
        first = cache.layers[0].keys
        if first.shape[0] != 1 or first.shape[2] != length:
            raise ValueError(f"expected a one-request cache of {length} tokens, found keys {list(first.shape)}")
        device = first.device
        row_mask = torch.ones(1, length, dtype=torch.long, device=device)
        row_pos = torch.tensor([length], dtype=torch.long, device=device)
        if self.cache is None:
            self.cache, self.mask, self.positions = cache, row_mask, row_pos
            return
        assert self.mask is not None and self.positions is not None
        width = max(self.width, length)
        grow, pad_row = width - self.width, width - length
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, grow), _pad_left(theirs.keys, pad_row)], dim=0)
            mine.values = torch.cat([_pad_left(mine.values, grow), _pad_left(theirs.values, pad_row)], dim=0)
        self.mask = torch.cat([F.pad(self.mask, (grow, 0)), F.pad(row_mask, (pad_row, 0))], dim=0)
        self.positions = torch.cat([self.positions, row_pos])

    def remove(self, rows: list[int]) -> None:
        """Drop ``rows`` (indices into the current batch), then the columns that became padding everywhere."""
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(self.size) if i not in gone]
        if not keep:
            self.clear()
            return
        assert self.mask is not None and self.positions is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(dim=0).nonzero()[0])  # the first column some row still uses
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, first:].contiguous()
            layer.values = layer.values.index_select(0, index)[:, :, first:].contiguous()
        self.mask = mask[:, first:]
        self.positions = self.positions.index_select(0, index)

    def step_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention_mask [B, L+1], position_ids [B, 1])`` for one new token per row."""
        assert self.mask is not None and self.positions is not None
        ones = torch.ones(self.size, 1, dtype=self.mask.dtype, device=self.mask.device)
        return torch.cat([self.mask, ones], dim=1), self.positions[:, None]

    def advance(self, step_mask: torch.Tensor) -> None:
        """After the forward appended one column: the step's mask is the batch's, every row one further."""
        assert self.positions is not None
        width = self.cache.layers[0].keys.shape[2]
        if step_mask.shape[1] != width:
            raise RuntimeError(f"the batch cache has {width} columns, its mask {step_mask.shape[1]}")
        self.mask = step_mask
        self.positions = self.positions + 1
