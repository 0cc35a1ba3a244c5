"""Decode attention for models running on the CPU: one query token, computed in fp32 per KV head.

torch's CPU SDPA runs a one-token query through its flash-attention kernel, which is built for
long queries: measured on this project's 2-core machine for 32 query heads over 4 KV heads of 128,
a bf16 decode step takes 430 us at 70 cached tokens and 4.1 ms at 600 (fp32: 50 us and 370 us),
against 62 us and 283 us for two small matmuls and a softmax in fp32 over the KV heads' groups. In a
4-layer Qwen3-30B-A3B-shaped model that was 40% of the main thread's time per decode step.

The decode path runs in the engine (``attn_decode``: bf16 or fp32 K/V read in place) when the
layout allows, else as the two matmuls in torch.

``attention_forward`` takes that shorter road for exactly the case it is for (a one-token query on
the CPU, no dropout, no position bias, soft-cap or attention sinks) and hands every other call
(prefill, GPUs, exotic options) to transformers' own ``sdpa_attention_forward`` unchanged. The math
is the same as SDPA's: ``softmax(q k^T * scaling + mask) v``, the mask boolean (False = hidden) or
additive, in fp32, so it is at least as accurate as the bf16 kernel it replaces.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.dispatch import engine_module

ATTENTION_NAME = "hetmoe_cpu_sdpa"


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
    if not _takes_decode_path(module, query, key, value, attention_mask, dropout, position_bias, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias, **kwargs
        )
    b, h, _, d = query.shape
    kv = key.shape[1]
    groups = h // kv
    scale = scaling if scaling is not None else d**-0.5
    q = query.reshape(b, kv, groups, d).float()  # the query heads sharing a KV head, side by side
    if _engine_takes(key, value, attention_mask, d):
        return _engine_attention(q, key, value, attention_mask, scale).reshape(b, 1, h, d).to(query.dtype), None
    scores = torch.matmul(q, key.float().transpose(-1, -2)) * scale  # [B, KV, G, L]
    if attention_mask is not None:
        mask = _grouped(attention_mask, b, kv, groups)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value.float())  # [B, KV, G, D]
    return out.reshape(b, 1, h, d).to(query.dtype), None


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
    q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
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
        m = mask.reshape(mask.shape[0], length)
        m = torch.zeros(m.shape).masked_fill_(~m, float("-inf")) if m.dtype == torch.bool else m.float()
        additive = m.expand(b, length).contiguous()
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
        (key.stride(0), key.stride(1), key.stride(2)),
        (value.stride(0), value.stride(1), value.stride(2)),
        additive.data_ptr() if additive is not None else 0,
        float(scale),
        out.data_ptr(),
    )
    return out


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
    if query.device.type != "cpu" or query.dim() != 4 or query.shape[2] != 1:
        return False
    if position_bias is not None or (dropout and module.training) or kwargs.get("output_attentions"):
        return False
    if any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks")):
        return False
    if key.shape[1] == 0 or query.shape[1] % key.shape[1] or key.shape[-1] != value.shape[-1]:
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
    """Switch a model on transformers' SDPA attention to this one; False (unchanged) for any other."""
    return switch_attention(model, ATTENTION_NAME, attention_forward, ("sdpa",))
