"""Decode attention for models running on the CPU: one query token, computed in fp32 per KV head.

torch's CPU SDPA runs a one-token query through its flash-attention kernel, which is built for
long queries: measured on this project's 2-core machine for 32 query heads over 4 KV heads of 128,
a bf16 decode step takes 430 us at 70 cached tokens and 4.1 ms at 600 (fp32: 50 us and 370 us),
against 62 us and 283 us for two small matmuls and a softmax in fp32 over the KV heads' groups. In a
4-layer Qwen3-30B-A3B-shaped model that was 40% of the main thread's time per decode step.

The decode path runs in the engine (``attn_decode``: bf16 or fp32 K/V read in place) when the
layout allows, else as the two matmuls in torch.

``attention_forward`` takes that shorter road for exactly the case it is for (a one-token query on
the CPU, no dropout, no position bias or soft-cap), prompts through the engine's prefill kernel, and
hands every other call (GPUs, exotic options) to transformers' own ``sdpa_attention_forward``
unchanged. The math is the same as SDPA's: ``softmax(q k^T * scaling + mask) v``, the mask boolean
(False = hidden) or additive, in fp32, so it is at least as accurate as the bf16 kernel it replaces.

gpt-oss adds attention sinks (``s_aux``: one logit per head that joins the softmax and is dropped
from it) and has no SDPA path in transformers: its model is switched from eager attention to this
one, the kernels take the sinks, and what they do not take goes to the model's own
``eager_attention_forward``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..kernels.dispatch import engine_module

ATTENTION_NAME = "hetmoe_cpu_sdpa"
# The same function for models whose class has no SDPA path (gpt-oss), under a name without "sdpa":
# transformers checks a model's SDPA support for any implementation named so.
EAGER_ATTENTION_NAME = "hetmoe_cpu_attention"
ATTENTION_NAMES = (ATTENTION_NAME, EAGER_ATTENTION_NAME)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query [B,H,q,D]``, ``key/value [B,KV,L,D]`` ->
    ``(out [B,q,H,D], None)``."""
    sinks = _sinks(kwargs.get("s_aux"), query.shape[1])
    if not _takes_decode_path(module, query, key, value, attention_mask, dropout, position_bias, kwargs):
        prefill = _prefill_plan(module, query, key, value, attention_mask, dropout, is_causal, position_bias, kwargs)
        if prefill is not None:
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return _engine_prefill(query, key, value, prefill, scale, sinks), None
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias, kwargs)
    b, h, _, d = query.shape
    kv = key.shape[1]
    groups = h // kv
    scale = scaling if scaling is not None else d**-0.5
    q = query.reshape(b, kv, groups, d).float()  # the query heads sharing a KV head, side by side
    if _engine_takes(key, value, attention_mask, d):
        out = _engine_attention(q, key, value, attention_mask, scale, sinks)
        return out.reshape(b, 1, h, d).to(query.dtype), None
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # [B, KV, G, L]
    if attention_mask is not None:
        mask = _grouped(attention_mask, b, kv, groups)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    if sinks is not None:  # one more logit a head, dropped after the softmax
        column = sinks.reshape(1, kv, groups, 1).expand(b, kv, groups, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value.float())  # [B, KV, G, D]
    return out.reshape(b, 1, h, d).to(query.dtype), None


def _sinks_fit(s_aux: Any, heads: int) -> bool:
    """gpt-oss's sinks as the kernels take them: a logit per query head. Sinks of another shape make
    the call not plain (``_plain_attention``)."""
    return isinstance(s_aux, torch.Tensor) and s_aux.shape == (heads,)


def _sinks(s_aux: Any, heads: int) -> torch.Tensor | None:
    """The sinks as the kernels read them (fp32 ``[heads]``, contiguous); None when the call has none."""
    return s_aux.detach().float().contiguous() if _sinks_fit(s_aux, heads) else None


def _fallback(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    position_bias: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, Any]:
    """What the kernels do not take: transformers' SDPA, or, for a model with sinks (SDPA has none),
    the model's own eager attention, given the mask as the additive one it expects."""
    if kwargs.get("s_aux") is not None:
        eager = sys.modules[type(module).__module__].eager_attention_forward
        additive = _additive(mask).to(query.dtype) if mask is not None and mask.dtype == torch.bool else mask
        return eager(module, query, key, value, additive, dropout=dropout, scaling=scaling, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, is_causal, position_bias, **kwargs)


_KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _engine_takes(key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, d: int) -> bool:
    """The engine's kernel reads bf16/fp32 K/V rows in place (unit stride along D, D a multiple of 16)
    and a mask shared by the heads; anything else takes the torch matmuls below."""
    if (
        key.dtype not in _KV_DTYPES
        or value.dtype != key.dtype
        or d % 16
        or key.stride(-1) != 1
        or value.stride(-1) != 1
    ):
        return False
    return mask is None or mask.shape[1] == 1


def _engine_attention(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The grouped queries ``q [B, KV, G, D]`` (fp32) over K/V in the engine: out ``[B, KV, G, D]`` fp32.

    One pass over each KV head's rows for all its query heads, reading bf16 K/V as stored, the
    (batch row, KV head) pairs spread over the engine's pool: the torch path converts the whole
    cache to fp32 every step (in a decode step of the 4-layer Qwen3-30B-A3B-shaped model at ~170
    cached tokens: 0.29 ms a layer, 0.17 ms here, 85 us of it the kernel)."""
    b, kv, groups, d = q.shape
    length = key.shape[2]
    q = q.contiguous()
    additive = None
    if mask is not None:
        additive = _additive(mask.reshape(mask.shape[0], length)).expand(b, length).contiguous()
    out = torch.empty_like(q)
    engine_module().attn_decode(
        q.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        _KV_DTYPES[key.dtype],
        b,
        kv,
        groups,
        length,
        d,
        _row_strides(key),
        _row_strides(value),
        additive.data_ptr() if additive is not None else 0,
        float(scale),
        out.data_ptr(),
        sinks=sinks.data_ptr() if sinks is not None else 0,
    )
    return out


# Masks are widened to fp32 [B, heads, T, L] for the kernel; past this many elements (64 MiB) SDPA
# keeps them.
PREFILL_MASK_ELEMENTS = 1 << 24


def _prefill_plan(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    is_causal: bool | None,
    position_bias: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor | None, bool] | None:
    """``(additive fp32 mask or None, causal)`` when the engine's prefill kernel computes this call
    exactly as SDPA would; None for SDPA. Without a mask, SDPA's causal mask is aligned to the top-left
    corner, which transformers only leaves to it when queries and keys are the same tokens."""
    if not _plain_attention(module, query, key, value, dropout, position_bias, kwargs) or query.shape[2] < 2:
        return None
    dk, dv = query.shape[-1], value.shape[-1]
    if key.shape[-1] != dk or dk % 16 or dv % 16 or key.dtype not in _KV_DTYPES or value.dtype != key.dtype:
        return None
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        return None
    b, h, t, length = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    if mask is None:
        causal = is_causal if is_causal is not None else bool(getattr(module, "is_causal", True))
        return (None, causal) if not causal or t == length else None
    return mask_plan(mask, b, h, t, length)


def mask_plan(mask: torch.Tensor, b: int, h: int, t: int, length: int) -> tuple[torch.Tensor, bool] | None:
    """``(additive fp32 mask [B, 1 or H, T, L], False)`` for the engine's prefill kernel from a boolean or
    additive mask of those dims (batch and heads may broadcast); None where the kernel does not take it
    (another layout, or more than PREFILL_MASK_ELEMENTS once widened)."""
    if mask.dim() != 4 or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, h) or mask.shape[2:] != (t, length):
        return None
    if b * mask.shape[1] * t * length > PREFILL_MASK_ELEMENTS:
        return None
    return _additive(mask.expand(b, mask.shape[1], t, length)).contiguous(), False


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """A K or V tensor's (batch, head, row) strides in elements, as the engine's kernels take them."""
    return t.stride(0), t.stride(1), t.stride(2)


def _additive(mask: torch.Tensor) -> torch.Tensor:
    """A boolean mask (False = hidden) as fp32 0 / -inf; an additive one as fp32, its dtype's minimum
    (how transformers' eager masks hide a key) as -inf, so the kernels weigh hidden keys exactly 0."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    hidden = mask <= torch.finfo(mask.dtype).min
    return mask.float().masked_fill(hidden, float("-inf"))  # not in place: the caller's mask stays


def _engine_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    plan: tuple[torch.Tensor | None, bool],
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query ``[B, H, T, Dk]`` over K ``[B, KV, L, Dk]``, V ``[B, KV, L, Dv]`` in the engine -> ``[B, T, H, Dv]``
    in the query's dtype (what SDPA's attention function returns), fp32 inside, K/V read as stored.

    torch's CPU SDPA runs at the one thread a CPU-only model gives torch, and computes the masked half
    of a causal prompt too: measured on the 4-layer Qwen3-30B-A3B-shaped model (2 cores), prefill of
    512 tokens spent 186 ms of 1076 there."""
    mask, causal = plan
    b, h, t, dk = query.shape
    kv, length, dv = key.shape[1], key.shape[2], value.shape[-1]
    q = query.float().contiguous()
    out = torch.empty(b, t, h, dv)
    engine_module().attn_prefill(
        q.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        _KV_DTYPES[key.dtype],
        b,
        h,
        kv,
        t,
        length,
        dk,
        dv,
        _row_strides(key),
        _row_strides(value),
        mask.data_ptr() if mask is not None else 0,
        mask.shape[1] if mask is not None else 1,
        length - t,
        causal,
        float(scale),
        out.data_ptr(),
        sinks=sinks.data_ptr() if sinks is not None else 0,
    )
    return out.to(query.dtype)


def _plain_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout: float,
    position_bias: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> bool:
    """softmax(q k^T * scale + mask) v on the CPU, with gpt-oss's sinks or none: no position bias,
    dropout or soft-cap."""
    if query.device.type != "cpu" or query.dim() != 4:
        return False
    if position_bias is not None or (dropout and module.training) or kwargs.get("output_attentions"):
        return False
    if any(kwargs.get(k) is not None for k in ("softcap", "sinks")):
        return False
    s_aux = kwargs.get("s_aux")
    # sinks of another shape, or ones that want a gradient: the model's own attention
    wants_grad = isinstance(s_aux, torch.Tensor) and s_aux.requires_grad and torch.is_grad_enabled()
    if s_aux is not None and (not _sinks_fit(s_aux, query.shape[1]) or wants_grad):
        return False
    return key.shape[1] > 0 and query.shape[1] % key.shape[1] == 0


def _takes_decode_path(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    position_bias: torch.Tensor | None,
    kwargs: dict[str, Any],
) -> bool:
    if not _plain_attention(module, query, key, value, dropout, position_bias, kwargs) or query.shape[2] != 1:
        return False
    if key.shape[-1] != value.shape[-1]:
        return False
    if mask is not None and (mask.dim() != 4 or mask.shape[2] != 1 or mask.shape[1] not in (1, query.shape[1])):
        return False
    return mask is None or mask.shape[-1] == key.shape[2]


def _grouped(mask: torch.Tensor, b: int, kv: int, groups: int) -> torch.Tensor:
    """A ``[B, 1 or H, 1, L]`` mask laid out like the grouped scores ``[B, KV, G, L]``."""
    if mask.shape[1] == 1:
        return mask.reshape(mask.shape[0], 1, 1, mask.shape[-1])
    return mask.reshape(mask.shape[0], kv, groups, mask.shape[-1])


_REGISTERED: set[str] = set()


def register_attention(name: str, fn: Any) -> None:
    """Make attention function ``fn`` known to transformers as ``name`` (with SDPA's mask builder); idempotent."""
    if name in _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    _REGISTERED.add(name)


def switch_attention(model: Any, name: str, fn: Any, replaces: tuple[str, ...]) -> bool:
    """Switch ``model`` to attention ``name`` when it uses one of ``replaces``; False (unchanged) otherwise."""
    current = getattr(model.config, "_attn_implementation", None)
    if current == name:
        return True
    if current not in replaces:
        return False
    register_attention(name, fn)
    model.set_attn_implementation(name)
    return True


def use_cpu_attention(model: Any) -> bool:
    """Switch a model on transformers' SDPA attention to this one, or on eager attention where its class
    has no SDPA path (gpt-oss); False (unchanged) for any other."""
    if getattr(model, "_supports_sdpa", True):
        return switch_attention(model, ATTENTION_NAME, attention_forward, ("sdpa",))
    return switch_attention(model, EAGER_ATTENTION_NAME, attention_forward, ("eager",))
