"""The padded batch cache and the batch-invariant decode attention, against unbatched ``generate``.

Requests join and leave the batch at different steps; every request's greedy tokens must equal
what transformers' ``generate`` gives for it alone on an independently loaded model, in bf16 (where
transformers' own padded SDPA would differ now and then).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiny_models import tiny_chat_model

from hetmoe import load_model
from hetmoe.serve.kv_batch import PaddedBatch, batchable
from hetmoe.serve.ragged_attention import ATTENTION_NAME, _left_padding, use_ragged_attention

PROMPTS = [[5, 9, 33], list(range(40, 61)), [7], list(range(100, 112)), [300, 301, 2, 17, 88, 90, 91]]
STEPS = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_cache):
    return tiny_chat_model(tiny_cache)


@pytest.fixture(scope="module")
def references(model_dir) -> list[list[int]]:
    """Greedy tokens of each prompt, alone, by transformers' generate on a separately loaded model."""
    model = load_model(model_dir, cpu_threads=1)
    out = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=[], pad_token_id=0)
            out.append(gen[0, len(p) :].tolist())
    return out


def _prefill(model, prompt: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, use_cache=True, logits_to_keep=1)
    return cache, int(out.logits[0, -1].float().argmax())


def _run_batched(model, schedule: dict[int, list[int]], leave_at: dict[int, int]) -> dict[int, list[int]]:
    """Prompts join at the step ``schedule`` says and leave after ``leave_at[i]`` tokens; all rows decode together."""
    batch = PaddedBatch()
    rows: list[int] = []
    tokens: dict[int, list[int]] = {}
    sizes = []
    with torch.inference_mode():
        for step in range(STEPS * 3):
            for i in schedule.get(step, []):
                cache, first = _prefill(model, PROMPTS[i])
                assert batchable(cache)
                batch.add(cache, len(PROMPTS[i]))
                rows.append(i)
                tokens[i] = [first]
            done = [r for r, i in enumerate(rows) if len(tokens[i]) >= leave_at[i]]
            batch.remove(done)
            rows = [i for r, i in enumerate(rows) if r not in done]
            if not rows:
                if step > max(schedule):
                    break
                continue
            assert batch.width == max(len(PROMPTS[i]) + len(tokens[i]) - 1 for i in rows)  # no dead columns
            mask, positions = batch.step_inputs()
            last = torch.tensor([[tokens[i][-1]] for i in rows])
            out = model(input_ids=last, attention_mask=mask, position_ids=positions, cache=batch.cache, use_cache=True)
            batch.advance(mask)
            sizes.append(len(rows))
            for r, i in enumerate(rows):
                tokens[i].append(int(out.logits[r, -1].float().argmax()))
    assert max(sizes) >= 3
    return tokens


def test_batched_greedy_decode_equals_unbatched_generate_in_bf16(model_dir, references) -> None:
    model = load_model(model_dir, cpu_threads=1)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert use_ragged_attention(model) and model.config._attn_implementation == ATTENTION_NAME
    # 0 and 1 start together; 2 joins at step 3 (shorter than the batch), 3 at step 5 (longer), 4 at step 8;
    # 2 leaves early, so the batch shrinks and its leading padding columns go.
    schedule = {0: [0, 1], 3: [2], 5: [3], 8: [4]}
    leave_at = {0: STEPS, 1: STEPS, 2: 4, 3: STEPS, 4: STEPS}
    got = _run_batched(model, schedule, leave_at)
    for i, ref in enumerate(references):
        assert got[i] == ref[: leave_at[i]], f"prompt {i}"


def test_padded_sdpa_is_close_but_the_ragged_path_is_exact(model_dir) -> None:
    """Plain SDPA over a padded batch is right up to rounding; the ragged attention reproduces the unbatched bits."""
    import torch.nn.functional as F
    from transformers import DynamicCache

    plain = load_model(model_dir, cpu_threads=1)
    ragged = load_model(model_dir, cpu_threads=1)
    use_ragged_attention(ragged)
    prompt = PROMPTS[3]
    with torch.inference_mode():
        for model, exact in ((plain, False), (ragged, True)):
            cache, first = _prefill(model, prompt)
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            alone = model(input_ids=torch.tensor([[first]]), cache=cache, use_cache=True).logits[0, -1]
            pad = 9
            padded = DynamicCache(ddp_cache_data=[(F.pad(k, (0, 0, pad, 0)), F.pad(v, (0, 0, pad, 0))) for k, v in kv])
            mask = torch.ones(1, pad + len(prompt) + 1, dtype=torch.long)
            mask[:, :pad] = 0
            pos = torch.tensor([[len(prompt)]])
            out = model(input_ids=torch.tensor([[first]]), attention_mask=mask, position_ids=pos, cache=padded)
            if exact:
                assert torch.equal(out.logits[0, -1], alone)
            else:
                torch.testing.assert_close(out.logits[0, -1].float(), alone.float(), atol=0.02, rtol=0.02)


def test_left_padding_detection() -> None:
    q = torch.zeros(3, 4, 1, 8)
    k = torch.zeros(3, 2, 5, 8)
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert _left_padding(valid[:, None, None, :], q, k) == [2, 0, 4]
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert _left_padding(holes[:, None, None, :], q, k) is None  # not left padding: the mask is used as is
    assert _left_padding(None, q, k) is None
    assert _left_padding(valid[:, None, None, :], torch.zeros(3, 4, 2, 8), k) is None  # a prefill


def test_padded_batch_bookkeeping(model_dir) -> None:
    model = load_model(model_dir, cpu_threads=1)
    batch = PaddedBatch()
    with torch.inference_mode():
        for p in (PROMPTS[0], PROMPTS[1], PROMPTS[2]):
            batch.add(_prefill(model, p)[0], len(p))
    assert batch.size == 3 and batch.width == len(PROMPTS[1])
    assert batch.mask.sum(1).tolist() == [3, 21, 1] and batch.positions.tolist() == [3, 21, 1]
    batch.remove([1])  # the longest leaves: the columns only it used go
    assert batch.size == 2 and batch.width == 3 and batch.cache.layers[0].keys.shape[2] == 3
    assert batch.mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    batch.remove([0, 1])
    assert batch.size == 0 and batch.cache is None
    with pytest.raises(ValueError, match="one-request cache of 5 tokens"), torch.inference_mode():
        batch.add(_prefill(model, PROMPTS[0])[0], 5)
