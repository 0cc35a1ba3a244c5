"""A decode step's rotary rows sliced from a table the rotary module made (models/rotary_table.py)
equal the module's own rows for that position, bit for bit."""

from __future__ import annotations

import pytest
import torch
from tiny_models import MODEL_TYPES, tiny_config

from hetmoe.models.rotary_table import TABLE_POSITIONS, rotary_at


def _rotary(model_type: str, **overrides) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    return model.model.rotary_emb


# every architecture's tiny model, and real head sizes (Qwen3's 128, DeepSeek's rope part of 64)
CASES = [(t, {}) for t in MODEL_TYPES] + [("qwen3_moe", {"head_dim": 128}), ("deepseek_v3", {"qk_rope_head_dim": 64})]


@pytest.mark.parametrize(("model_type", "overrides"), CASES, ids=[f"{t}{o}" for t, o in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_from_the_table_equal_the_modules_own(model_type, overrides, dtype):
    rotary = _rotary(model_type, **overrides)
    x = torch.zeros(1, 1, 4, dtype=dtype)
    for position in [0, 1, 37, TABLE_POSITIONS - 1, TABLE_POSITIONS, 2 * TABLE_POSITIONS + 5, 3]:
        got = rotary_at(rotary, x, position)
        want = rotary(x, position_ids=torch.tensor([[position]]))
        if isinstance(want, torch.Tensor):  # DeepSeek-V2: one complex tensor, made by the module each time
            assert torch.equal(got, want)
            continue
        (cos, sin), (want_cos, want_sin) = got, want
        assert cos.shape == want_cos.shape and cos.dtype == dtype and cos.is_contiguous()
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), position


def test_new_frequencies_make_a_new_table():
    rotary = _rotary("qwen3_moe")
    x = torch.zeros(1, 1, 4)
    before = rotary_at(rotary, x, 5)[0].clone()
    with torch.no_grad():
        rotary.inv_freq.mul_(2)  # written in place: a new version
    after = rotary_at(rotary, x, 5)[0]
    assert not torch.equal(before, after)
    assert torch.equal(after, rotary(x, position_ids=torch.tensor([[5]]))[0])


def test_a_dynamic_rope_is_called_directly(monkeypatch):
    rotary = _rotary("qwen3_moe")
    monkeypatch.setattr(rotary, "rope_type", "dynamic", raising=False)
    calls = []
    real = rotary.forward
    monkeypatch.setattr(
        rotary, "forward", lambda x, position_ids: calls.append(position_ids.tolist()) or real(x, position_ids)
    )
    rotary_at(rotary, torch.zeros(1, 1, 4), 9)
    assert calls == [[[9]]]
