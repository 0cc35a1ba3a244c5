"""A KV cache that appends in place: transformers' DynamicCache without a copy of the cache per token.

transformers' ``DynamicLayer.update`` concatenates: every decode step copies the whole layer cache
into a new tensor, O(context) work per token and layer (0.3 ms a token for the 4-layer
Qwen3-30B-A3B-shaped benchmark model at ~170 cached tokens, and growing with the context).
``GrowingLayer`` keeps each layer's keys and values in a buffer with spare capacity, grown by a
quarter when full (amortized O(1) copies a token), and exposes the filled part as views, so
``layer.keys`` / ``layer.values`` have the shapes transformers expects (strided along the
sequence axis). Whatever replaces those tensors from outside (``crop``, ``reorder_cache``, an
offload) is noticed by identity and adopted into a fresh buffer on the next update.

``SlidingLayer`` does the same for transformers' ``DynamicSlidingWindowLayer`` (gpt-oss's sliding
layers): it shows the last ``sliding_window - 1`` rows as transformers' layer does, in a buffer of
spare capacity that slides them back to its front when full (every ``capacity - window`` tokens).

``growing_cache(config)`` is a DynamicCache whose attention layers are these; pass it as
``past_key_values`` / ``cache``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

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

    def free_row(
        self, heads: int, dim: int, dtype: torch.dtype, value_dim: int | None = None
    ) -> tuple[int, torch.Tensor, torch.Tensor, int] | None:
        """``(row, key buffer, value buffer, first)`` when one sequence's next key/value row can be written
        into the buffers in place at ``row`` (they exist, hold what ``keys``/``values`` show, have room,
        and are ``[1, heads, capacity, dim]`` of ``dtype``, contiguous as ``_grow`` makes them; values
        ``value_dim`` wide where given: 0 for MLA's latent rows, models/mla_attention.py), the new
        token attending over rows ``first .. row``; None otherwise (``update`` then does it). ``commit``
        makes the written row visible."""
        kbuf, vbuf = self._kbuf, self._vbuf
        if kbuf is None or vbuf is None or self._len >= kbuf.shape[-2]:
            return None
        if self.keys is not getattr(self, "_kview", None) or self.values is not getattr(self, "_vview", None):
            return None
        if not _buffers_fit(kbuf, vbuf, heads, dim, dtype, dim if value_dim is None else value_dim):
            return None
        return self._len, kbuf, vbuf, 0

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


def _buffers_fit(
    kbuf: torch.Tensor, vbuf: torch.Tensor, heads: int, dim: int, dtype: torch.dtype, value_dim: int
) -> bool:
    return all(
        buf.dim() == 4 and buf.shape[:2] == (1, heads) and buf.shape[-1] == width and buf.dtype == dtype
        for buf, width in ((kbuf, dim), (vbuf, value_dim))
    )


class SlidingLayer(DynamicSlidingWindowLayer):
    """transformers' sliding-window layer (``keys``/``values``: the last ``sliding_window - 1`` tokens,
    ``cumulative_length`` all of them) whose one-token steps append in place: rows ``[start, len)`` of
    a buffer are what it shows. ``update`` (prompts, transformers' own forward) is transformers' own
    concatenation; the next ``free_row`` adopts its result into a buffer again."""

    def __init__(self, sliding_window: int, **kwargs: Any) -> None:
        super().__init__(sliding_window, **kwargs)
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._start = self._len = 0

    def _shown(self) -> bool:
        """``keys``/``values`` are still this layer's views of its buffers (nothing replaced them)."""
        return (
            self._kbuf is not None
            and self.keys is getattr(self, "_kview", None)
            and (self.values is getattr(self, "_vview", None))
        )

    def free_row(self, heads: int, dim: int, dtype: torch.dtype) -> tuple[int, torch.Tensor, torch.Tensor, int] | None:
        """As GrowingLayer.free_row; ``first`` is where the window's cached rows start."""
        if not self.is_initialized or self.record_past or self.keys.dim() != 4:
            return None
        keep = self.sliding_window - 1
        if not self._shown():  # a prompt or transformers' update replaced them: adopt into a buffer
            shown = self.keys.shape[-2]
            if shown > keep or self.values.shape[-2] != shown:
                return None
            capacity = max(_MIN_CAPACITY, 2 * self.sliding_window)
            kbuf = self.keys.new_empty((*self.keys.shape[:-2], capacity, self.keys.shape[-1]))
            vbuf = self.values.new_empty((*self.values.shape[:-2], capacity, self.values.shape[-1]))
            kbuf[..., :shown, :].copy_(self.keys)
            vbuf[..., :shown, :].copy_(self.values)
            self._kbuf, self._vbuf, self._start, self._len = kbuf, vbuf, 0, shown
            self._show()
        kbuf, vbuf = self._kbuf, self._vbuf
        assert kbuf is not None and vbuf is not None
        if not _buffers_fit(kbuf, vbuf, heads, dim, dtype, dim):
            return None
        if self._len >= kbuf.shape[-2]:  # full: the window's rows back to the front
            n = self._len - self._start
            kbuf[..., :n, :].copy_(kbuf[..., self._start : self._len, :].clone())
            vbuf[..., :n, :].copy_(vbuf[..., self._start : self._len, :].clone())
            self._start, self._len = 0, n
            self._show()
        return self._len, kbuf, vbuf, self._start

    def commit(self, rows: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Show the row written at ``free_row()``'s row, and only the last ``sliding_window - 1``."""
        assert self._kbuf is not None and self._len + rows <= self._kbuf.shape[-2]
        self._len += rows
        self.cumulative_length += rows
        self._start = max(self._start, self._len - (self.sliding_window - 1))
        self._show()
        return self.keys, self.values

    def _show(self) -> None:
        assert self._kbuf is not None and self._vbuf is not None
        self.keys = self._kview = self._kbuf[..., self._start : self._len, :]
        self.values = self._vview = self._vbuf[..., self._start : self._len, :]

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None
        self._start = self._len = 0


def growing_cache(config: Any) -> DynamicCache:
    """A DynamicCache for ``config`` whose attention layers append in place (GrowingLayer, SlidingLayer)."""
    cache = DynamicCache(config=config)
    layers = []
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer = GrowingLayer()
        elif type(layer) is DynamicSlidingWindowLayer:
            layer = SlidingLayer(layer.sliding_window)
        layers.append(layer)
    cache.layers = layers
    return cache


def generate_grows_caches(model: Any) -> None:
    """Make ``model.generate`` start from ``growing_cache`` wherever it would make a plain DynamicCache
    itself (no ``cache`` passed, no ``cache_implementation`` asked for): a Python caller of
    ``load_model(...).generate(ids)`` then gets the in-place cache, and with it the one-call decode
    step (models/fast_decode.py writes its rows with ``free_row``), as ``hetmoe generate`` does. A cache
    the caller passes, any other cache kind, and an assistant model's (which records its past) are
    left as transformers makes them."""
    original = model._prepare_cache_for_generation

    def prepare(generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        made = original(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get("cache")
        if (
            type(cache) is DynamicCache
            and not getattr(cache, "_is_user_defined", False)
            and not getattr(generation_config, "is_assistant", False)
            and generation_config.cache_implementation in (None, "dynamic")
            and cache.get_seq_length() == 0
        ):
            model_kwargs["cache"] = growing_cache(model.config.get_text_config(decoder=True))
        return made

    model._prepare_cache_for_generation = prepare
