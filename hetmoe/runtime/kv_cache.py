"""A KV cache that appends in place: transformers' DynamicCache without a copy of the cache per token.

transformers' ``DynamicLayer.update`` concatenates: every decode step copies the whole layer cache
into a new tensor, O(context) work per token and layer (0.3 ms a token for the 4-layer
Qwen3-30B-A3B-shaped benchmark model at ~170 cached tokens, and growing with the context).
``GrowingLayer`` keeps each layer's keys and values in a buffer with spare capacity, grown by a
quarter when full (amortized O(1) copies a token), and exposes the filled part as views, so
``layer.keys`` / ``layer.values`` have the shapes transformers expects (strided along the
sequence axis). Whatever replaces those tensors from outside (``crop``, ``reorder_cache``, an
offload) is noticed by identity and adopted into a fresh buffer on the next update.

``growing_cache(config)`` is a DynamicCache whose full-attention layers are GrowingLayers (sliding
window layers stay as transformers makes them); pass it as ``past_key_values`` / ``cache``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

_MIN_CAPACITY = 256


class GrowingLayer(DynamicLayer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
        """Start a buffer holding ``keys``/``values`` (what the layer holds now) with room for ``extra``."""
        self._len = keys.shape[-2] if keys.numel() else 0
        self._kbuf = self._vbuf = None
        if self._len:
            self._grow(keys, values, self._len + extra)

    def _grow(self, keys: torch.Tensor, values: torch.Tensor, need: int) -> None:
        have = self._kbuf.shape[-2] if self._kbuf is not None else 0
        capacity = max(need, have + max(_MIN_CAPACITY, have // 4))
        kbuf = keys.new_empty((*keys.shape[:-2], capacity, keys.shape[-1]))
        vbuf = values.new_empty((*values.shape[:-2], capacity, values.shape[-1]))
        if self._len:
            kbuf[..., : self._len, :].copy_(keys[..., : self._len, :])
            vbuf[..., : self._len, :].copy_(values[..., : self._len, :])
        self._kbuf, self._vbuf = kbuf, vbuf

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._kbuf = self._vbuf = None
            self._len = 0
        n = key_states.shape[-2]
        if self._kbuf is None or self.keys is not getattr(self, "_kview", None) or self.values is not self._vview:
            self._adopt(self.keys, self.values, n)  # first update, or replaced from outside
        if self._kbuf is not None and (
            self._kbuf.shape[:-2] != key_states.shape[:-2]
            or self._kbuf.shape[-1] != key_states.shape[-1]
            or self._vbuf.shape[-1] != value_states.shape[-1]
            or self._kbuf.dtype != key_states.dtype
            or self._kbuf.device != key_states.device
        ):
            raise ValueError(
                f"KV cache update: states {list(key_states.shape)} {key_states.dtype} do not continue the cached "
                f"{list(self._kbuf.shape[:-2])} x {self._kbuf.shape[-1]} {self._kbuf.dtype}"
            )
        need = self._len + n
        if self._kbuf is None or need > self._kbuf.shape[-2]:
            self._grow(self.keys if self._len else key_states, self.values if self._len else value_states, need)
        assert self._kbuf is not None and self._vbuf is not None
        self._kbuf[..., self._len : need, :].copy_(key_states)
        self._vbuf[..., self._len : need, :].copy_(value_states)
        return self.commit(n)

    def free_row(self, heads: int, dim: int, dtype: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """``(row, key buffer, value buffer)`` when one sequence's next key/value row can be written into
        the buffers in place at ``row`` (they exist, hold what ``keys``/``values`` show, have room, and
        are ``[1, heads, capacity, dim]`` of ``dtype``, contiguous as ``_grow`` makes them); None
        otherwise (``update`` then does it). ``commit`` makes the written row visible."""
        kbuf, vbuf = self._kbuf, self._vbuf
        if kbuf is None or vbuf is None or self._len >= kbuf.shape[-2]:
            return None
        if self.keys is not getattr(self, "_kview", None) or self.values is not getattr(self, "_vview", None):
            return None
        for buf in (kbuf, vbuf):
            if buf.dim() != 4 or buf.shape[:2] != (1, heads) or buf.shape[-1] != dim or buf.dtype != dtype:
                return None
        return self._len, kbuf, vbuf

    def commit(self, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Show ``rows`` more rows, written into the buffers at ``free_row()`` by the caller."""
        assert self._kbuf is not None and self._vbuf is not None and self._len + rows <= self._kbuf.shape[-2]
        self._len += rows
        self.keys = self._kview = self._kbuf[..., : self._len, :]
        self.values = self._vview = self._vbuf[..., : self._len, :]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None
        self._len = 0


def growing_cache(config: Any) -> DynamicCache:
    """A DynamicCache for ``config`` whose full-attention layers append in place (GrowingLayer)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
