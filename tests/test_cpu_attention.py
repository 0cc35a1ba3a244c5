"""hetmoe's CPU attention (one-token decode, and the engine's prefill kernel) against transformers'
own SDPA attention function."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hetmoe.models.cpu_attention import ATTENTION_NAME, attention_forward


class _Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(b: int, h: int, kv: int, q_len: int, length: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, q_len, 64, generator=g).to(dtype)
    k = torch.randn(b, kv, length, 64, generator=g).to(dtype)
    v = torch.randn(b, kv, length, 64, generator=g).to(dtype)
    return q, k, v


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# groups of 1, 4, 8, 12 and 16 query heads a KV head: the engine takes them 8 at a time
@pytest.mark.parametrize(("h", "kv"), [(8, 8), (8, 2), (8, 1), (24, 2), (16, 1)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "bool-heads", "additive"])
def test_decode_step_equals_sdpa(h: int, kv: int, mask_kind: str | None) -> None:
    b, length = 3, 37
    q, k, v = _inputs(b, h, kv, 1, length, torch.float32)
    mask = None
    visible = torch.rand(b, 1, 1, length, generator=torch.Generator().manual_seed(1)) > 0.3
    visible[..., -1] = True  # a decode step always sees its own key
    if mask_kind == "bool":
        mask = visible
    elif mask_kind == "bool-heads":
        mask = visible.expand(b, h, 1, length).clone()
        mask[:, 0, :, :5] = False  # a head-specific mask must stay with its head
    elif mask_kind == "additive":
        mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)
    module = _Attn(h // kv)
    got, _ = attention_forward(module, q, k, v, mask, scaling=0.125)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.125)
    assert got.shape == want.shape == (b, 1, h, 64)
    assert rel(got, want) <= 1e-6


def test_bf16_decode_is_at_least_as_accurate_as_sdpa() -> None:
    q, k, v = _inputs(2, 8, 2, 1, 300, torch.bfloat16)
    module = _Attn(4)
    exact, _ = sdpa_attention_forward(module, q.double(), k.double(), v.double(), None)
    got, _ = attention_forward(module, q, k, v, None)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None)
    assert got.dtype == torch.bfloat16
    assert rel(got, exact) <= rel(theirs, exact) + 2**-9


def _prefill_mask(kind: str | None, b: int, h: int, t: int, length: int) -> torch.Tensor | None:
    """transformers' masks for a prompt of t tokens after length - t cached ones: causal, with left
    padding in row 0 (bool), per head (bool), or additive with the dtype's minimum."""
    if kind is None:
        return None
    past = length - t
    causal = torch.arange(length)[None, :] <= (past + torch.arange(t))[:, None]
    mask = causal[None, None].expand(b, 1, t, length).clone()
    mask[0, :, :, :3] = False  # row 0 is left-padded by 3 tokens
    if kind == "bool-heads":
        mask = mask.expand(b, h, t, length).clone()
        mask[:, 1, :, past : past + 2] = False
    if kind == "additive":
        return torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    return mask


def _isas() -> list[str]:
    from hetmoe.kernels.dispatch import engine_module

    feats = engine_module().cpu_features()
    return [isa for isa in ("avx2", "avx512") if feats[f"can_{isa}"]]


@pytest.fixture(params=_isas())
def isa(request, keep_isa):
    from hetmoe.kernels import select_isa

    select_isa(request.param)
    return request.param


@pytest.mark.parametrize(("h", "kv", "dim"), [(8, 8, 64), (8, 2, 128), (4, 1, 32)])
@pytest.mark.parametrize(
    ("mask_kind", "past"), [(None, 0), ("bool", 0), ("bool", 9), ("bool-heads", 5), ("additive", 0)]
)
def test_prefill_equals_sdpa(isa: str, h: int, kv: int, dim: int, mask_kind: str | None, past: int) -> None:
    """Several query tokens (a prompt, or a prompt continuing a cache) through the engine's kernel, on
    every ISA variant: fp32 within rounding of SDPA, over more keys than one block of 64 and a ragged
    last block."""
    b, t = 2, 70
    q, k, v = _inputs(b, h, kv, t, past + t, torch.float32, seed=t + past)
    if dim != 64:
        g = torch.Generator().manual_seed(dim)
        q, k, v = (torch.randn(*x.shape[:-1], dim, generator=g) for x in (q, k, v))
    mask = _prefill_mask(mask_kind, b, h, t, past + t)
    module = _Attn(h // kv)
    got, _ = attention_forward(module, q, k, v, mask, scaling=dim**-0.5)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=dim**-0.5)
    if mask is not None:  # row 0's padded queries see nothing: SDPA's answer there is not defined
        got, want = got[:, 3:], want[:, 3:]
    assert got.shape == want.shape
    assert rel(got, want) <= 1e-6


def test_prefill_with_other_value_size_and_bf16_caches() -> None:
    """MLA's K of 192 and V of 128 per head; bf16 K/V read as stored: at least as accurate as SDPA's
    bf16 kernel against the float64 answer."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 4, 90, 192, generator=g), torch.randn(1, 4, 90, 192, generator=g)
    v = torch.randn(1, 4, 90, 128, generator=g)
    scores = (q.double() @ k.double().transpose(-1, -2)) * 192**-0.5
    scores = scores.masked_fill(torch.ones(90, 90, dtype=torch.bool).triu(1), float("-inf"))
    exact = (scores.softmax(-1) @ v.double()).transpose(1, 2)
    got, _ = attention_forward(_Attn(1), q, k, v, None, scaling=192**-0.5)
    assert got.shape == (1, 90, 4, 128) and rel(got, exact) <= 1e-6
    q16, k16, v16 = _inputs(2, 8, 2, 100, 100, torch.bfloat16)
    module = _Attn(4)
    exact16, _ = sdpa_attention_forward(module, q16.double(), k16.double(), v16.double(), None)
    theirs, _ = sdpa_attention_forward(module, q16, k16, v16, None)
    ours, _ = attention_forward(module, q16, k16, v16, None)
    assert ours.dtype == torch.bfloat16 and rel(ours, exact16) <= rel(theirs, exact16) + 2**-9


def test_other_calls_go_to_sdpa_unchanged(monkeypatch) -> None:
    """A position bias, dropout in training, head sizes that are not a multiple of 16, and a prompt
    continuing a cache without a mask (SDPA aligns its causal mask top-left) are SDPA's business."""
    import transformers.integrations.sdpa_attention as sdpa

    calls: list[int] = []
    real = sdpa.sdpa_attention_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", counting)
    module = _Attn(2)
    q, k, v = _inputs(1, 4, 2, 5, 5, torch.float32)
    got, _ = attention_forward(module, q, k, v, None)
    assert not calls and rel(got, real(module, q, k, v, None)[0]) <= 1e-6  # the engine's prefill
    attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 4, 5, 5))
    assert len(calls) == 1
    attention_forward(module, q[:, :, 2:], k, v, None)  # 3 queries after 2 cached keys, no mask
    assert len(calls) == 2
    q40, k40, v40 = (torch.randn(1, x.shape[1], 5, 40) for x in (q, k, v))
    attention_forward(module, q40, k40, v40, None)
    assert len(calls) == 3
    calls.clear()
    q1 = q[:, :, :1]
    attention_forward(module, q1, k, v, None, position_bias=torch.zeros(1, 4, 1, 5))
    assert calls
    calls.clear()
    attention_forward(module, q1, k, v, None)
    assert not calls  # the decode path itself


def test_load_model_uses_it_on_the_cpu(tiny_cache) -> None:
    """And the model's outputs are transformers' own (fp32: within rounding) through a generate."""
    from transformers import AutoModelForCausalLM

    from hetmoe import load_model

    path = tiny_cache.model("qwen3_moe")
    ours = load_model(path, method="bf16", dtype=torch.float32, cpu_threads=1)
    assert ours.config._attn_implementation == ATTENTION_NAME
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    prompt = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "output_scores": True}
    kw["return_dict_in_generate"] = True
    a, b = ours.generate(prompt, **kw), theirs.generate(prompt, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for sa, sb in zip(a.scores, b.scores, strict=True):
        assert rel(sa, sb) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [128, 40])  # 40: not a multiple of 16, the torch matmuls instead
def test_engine_kernel_reads_strided_bf16_caches(dtype: torch.dtype, dim: int) -> None:
    """K/V as a static cache holds them (rows of a longer buffer: strided views), bf16 as stored."""
    g = torch.Generator().manual_seed(3)
    b, h, kv, length = 2, 8, 2, 53
    q = torch.randn(b, h, 1, dim, generator=g).to(dtype)
    buf_k = torch.randn(b, kv, 80, dim, generator=g).to(dtype)
    buf_v = torch.randn(b, kv, 80, dim, generator=g).to(dtype)
    k, v = buf_k[:, :, :length], buf_v[:, :, :length]
    visible = torch.rand(1, 1, 1, length, generator=g) > 0.2
    visible[..., -1] = True
    module = _Attn(h // kv)
    got, _ = attention_forward(module, q, k, v, visible, scaling=dim**-0.5)
    exact, _ = sdpa_attention_forward(
        module, q.double(), k.double(), v.double(), visible.expand(b, 1, 1, length), scaling=dim**-0.5
    )
    assert got.dtype == dtype and got.shape == (b, 1, h, dim)
    # fp32 math on the stored values; only the output's rounding to the model dtype remains
    assert rel(got, exact) <= (2**-8 if dtype == torch.bfloat16 else 1e-6)


class _SinkAttn(_Attn):
    """What gpt-oss's eager attention reads of its module: the groups, and a sink logit per head."""

    def __init__(self, groups: int, heads: int, seed: int) -> None:
        super().__init__(groups)
        self.sinks = torch.nn.Parameter(torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2)


@pytest.mark.parametrize(("h", "kv"), [(8, 2), (16, 1), (4, 4)])
@pytest.mark.parametrize("q_len", [1, 70])
def test_sinks_equal_gpt_oss_eager_attention(isa: str, h: int, kv: int, q_len: int) -> None:
    """gpt-oss's attention sinks (a logit per head that joins the softmax and is dropped) through the
    decode and prefill kernels, on every ISA variant, against transformers' gpt-oss eager attention in
    fp32: within fp32 rounding (1e-6 relative), with its causal sliding-window mask (the eager float
    mask, its hidden keys at the dtype's minimum) over a cache of 30 tokens."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    b, past, window = 2, 30, 24
    length = past + q_len
    q, k, v = _inputs(b, h, kv, q_len, length, torch.float32, seed=h + q_len)
    module = _SinkAttn(h // kv, h, seed=q_len)
    pos = past + torch.arange(q_len)[:, None]
    keys = torch.arange(length)[None, :]
    visible = (keys <= pos) & (keys > pos - window)
    mask = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None].expand(b, 1, q_len, length)
    with torch.no_grad():
        got, _ = attention_forward(module, q, k, v, mask, scaling=0.125, s_aux=module.sinks)
        want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.125)
        plain, _ = attention_forward(module, q, k, v, mask, scaling=0.125)
    assert got.shape == want.shape == (b, q_len, h, 64)
    assert rel(got, want) <= 1e-6
    assert rel(plain, want) > 1e-2  # the sinks change the answer: the test could fail


def test_sinks_go_to_the_models_eager_attention_where_the_kernels_do_not_apply() -> None:
    """A head size the kernels do not take (40) with sinks: the prompt goes to gpt-oss's own eager
    attention (not SDPA, which has no sinks), its boolean mask made additive; the one-token step runs
    the torch matmuls with the sink column."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = _SinkAttn(2, 4, seed=7)
    module.__class__.__module__ = "transformers.models.gpt_oss.modeling_gpt_oss"
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, n, 6, 40, generator=g) for n in (4, 2, 2))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        got, _ = attention_forward(module, q, k, v, causal, scaling=0.2, s_aux=module.sinks)
        additive = torch.where(causal, 0.0, float("-inf"))
        want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.2)
        assert rel(got, want) <= 1e-6
        step, _ = attention_forward(module, q[:, :, -1:], k, v, None, scaling=0.2, s_aux=module.sinks)
        want1, _ = eager_attention_forward(module, q[:, :, -1:], k, v, None, scaling=0.2)
    assert rel(step, want1) <= 1e-6
