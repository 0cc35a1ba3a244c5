"""GrowingLayer (runtime/kv_cache.py) against transformers' DynamicLayer, and generate with it."""

from __future__ import annotations

import itertools

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from hetmoe.runtime.kv_cache import GrowingLayer, growing_cache


def _states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, n, 8, generator=g).bfloat16(), torch.randn(2, 3, n, 8, generator=g).bfloat16()


def test_same_keys_and_values_as_dynamic_layer_through_growth_crop_and_reorder() -> None:
    ours, theirs = GrowingLayer(), DynamicLayer()
    steps = [300, *([1] * 40), 7, *([1] * 300)]  # a prefill, decode steps, a chunk, past two growths
    for i, n in enumerate(steps):
        k, v = _states(n, i)
        ko, vo = ours.update(k, v)
        kt, vt = theirs.update(k, v)
        assert torch.equal(ko, kt) and torch.equal(vo, vt)
        if i == 20:
            ours.crop(-5)
            theirs.crop(-5)
        if i == 30:
            beams = torch.tensor([1, 0])
            ours.reorder_cache(beams)
            theirs.reorder_cache(beams)
    assert ours.get_seq_length() == theirs.get_seq_length() == sum(steps) - 5
    ours.reset()
    k, v = _states(3, 99)
    assert torch.equal(ours.update(k, v)[0], k)


def test_appends_without_copying_the_cache() -> None:
    layer = GrowingLayer()
    layer.update(*_states(10, 0))
    buffer = layer.keys.untyped_storage().data_ptr()
    for i in range(50):
        layer.update(*_states(1, i + 1))
    assert layer.keys.untyped_storage().data_ptr() == buffer  # the same buffer: appended in place


def test_generate_with_it_equals_generate_without(tiny_cache, monkeypatch) -> None:
    """A loaded model's generate() makes a growing cache itself where the caller passes none (what
    README's Python example does), and so takes the one-call decode step (a DynamicCache has no
    ``free_row``, so every step went through the separate calls); the tokens are those of generate with
    transformers' own DynamicCache, which a cache passed in stays."""
    import hetmoe.models.fast_decode as fast_decode
    from hetmoe import load_model

    model = load_model(tiny_cache.model("qwen3_moe"))
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    one_call = []
    block = fast_decode._one_token_block
    monkeypatch.setattr(fast_decode, "_one_token_block", lambda *a: one_call.append(r := block(*a)) or r)
    kwargs = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    with torch.inference_mode():
        plain = model.generate(ids, cache=DynamicCache(config=model.config), **kwargs)
        assert type(plain.past_key_values.layers[0]) is DynamicLayer
        assert one_call and all(r is None for r in one_call)  # no free_row: the step-by-step path
        one_call.clear()
        default = model.generate(ids, **kwargs)
        grown = model.generate(ids, cache=growing_cache(model.config), **kwargs)
    assert all(type(layer) is GrowingLayer for layer in default.past_key_values.layers)
    assert one_call and all(r is not None for r in one_call)  # both: every step in one call a layer
    assert torch.equal(plain.sequences, default.sequences) and torch.equal(plain.sequences, grown.sequences)


def test_rows_written_in_place_then_committed() -> None:
    """free_row/commit (the fused one-token attention writes k and v into the buffers itself): the row
    offered is the next one, committing shows it, and a full, replaced or mismatched cache offers none."""
    layer = GrowingLayer()
    assert layer.free_row(2, 8, torch.float32) is None  # nothing yet
    k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    layer.update(k, v)
    free = layer.free_row(2, 8, torch.float32)
    assert free is not None and free[0] == 3 and free[1] is layer._kbuf and free[2] is layer._vbuf
    row = free[0]
    assert layer.free_row(2, 8, torch.bfloat16) is None and layer.free_row(4, 8, torch.float32) is None
    nk, nv = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    layer._kbuf[:, :, row] = nk[:, :, 0]
    layer._vbuf[:, :, row] = nv[:, :, 0]
    keys, values = layer.commit(1)
    assert torch.equal(keys, torch.cat([k, nk], 2)) and torch.equal(values, torch.cat([v, nv], 2))
    assert layer.get_seq_length() == 4
    layer.crop(-2)  # replaced from outside: the next update adopts it, nothing is written in place before
    assert layer.get_seq_length() == 2 and layer.free_row(2, 8, torch.float32) is None
    layer.update(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
    rest = layer._kbuf.shape[-2] - layer.get_seq_length()
    layer.update(torch.randn(1, 2, rest, 8), torch.randn(1, 2, rest, 8))
    assert layer.free_row(2, 8, torch.float32) is None  # full


def test_sliding_layer_shows_what_transformers_sliding_layer_shows(monkeypatch) -> None:
    """SlidingLayer against transformers' DynamicSlidingWindowLayer: prompts through ``update``,
    one-token steps written in place (free_row/commit), past the window and past the buffer's capacity
    (where the window's rows slide back to its front), then a prompt chunk and steps again. The cached
    rows a step attends over (``first .. row - 1``, then its own) are exactly transformers' cached rows."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    import hetmoe.runtime.kv_cache as kv_cache

    monkeypatch.setattr(kv_cache, "_MIN_CAPACITY", 0)  # capacity 2 x window: slides every ~10 steps
    window = 10
    ours, theirs = kv_cache.SlidingLayer(window), DynamicSlidingWindowLayer(window)
    rows: list[int] = []
    for i, n in enumerate([4, *([1] * 30), 3, *([1] * 12)]):
        k, v = (x[:1] for x in _states(n, i))  # one sequence
        cached_k, cached_v = theirs.keys, theirs.values
        theirs.update(k, v)
        free = ours.free_row(3, 8, torch.bfloat16) if n == 1 else None
        if free is None:
            ours.update(k, v)
        else:
            row, kbuf, vbuf, first = free
            rows.append(row)
            assert torch.equal(kbuf[:, :, first:row], cached_k) and torch.equal(vbuf[:, :, first:row], cached_v)
            kbuf[:, :, row] = k[:, :, 0]
            vbuf[:, :, row] = v[:, :, 0]
            ours.commit(1)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values), i
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)
    assert len(rows) == 42  # every step after the first prompt's and the chunk's was written in place
    assert any(b < a for a, b in itertools.pairwise(rows))  # the rows slid back at least once
    assert ours._kbuf is not None and ours._kbuf.shape[-2] == 2 * window
