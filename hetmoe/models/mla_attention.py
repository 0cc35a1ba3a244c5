"""Multi-head latent attention (DeepSeek-V2/V3/R1, Kimi-K2) on the CPU, in the absorbed form.

transformers' MLA caches the compressed latent (``kv_lora_rank`` normed values and the
``qk_rope_head_dim`` rotated key) but expands the whole cache through ``kv_b_proj`` on every forward:
per decode step and layer that is ``context x kv_lora_rank x heads x (nope + v)`` multiply-adds
(DeepSeek-V2-Lite's shapes at 600 cached tokens: 1.3 GFLOP a layer), then per-head attention over
the expanded K/V. The absorbed form does the same arithmetic in the other association order:

- ``kv_b_proj``'s weight is per head ``[W_UK (nope rows); W_UV (v rows)] x kv_lora_rank``. Since
  ``q_nope . (W_UK c) = (W_UK^T q_nope) . c``, the query is carried into latent space once per token
  (``q_lat = W_UK^T q_nope``, ``kv_lora_rank`` wide), and every head attends over the cached rows
  ``[c | k_rope]`` as one shared KV head: scores ``q_lat . c + q_rope . k_rope``.
- The values are the latents themselves; ``W_UV`` is applied to each head's weighted latent sum
  after attention.

The cache holds, per token and layer, one row ``[c (kv_lora_rank) | k_rope (qk_rope_head_dim)]`` in
the model's dtype, as the layer's "keys" (its "values" are zero-wide): exactly
``(kv_lora_rank + qk_rope_head_dim) x element size`` bytes a token and layer, never the expanded K/V.
The engine's attention kernels read those rows in place as K (all of the row) and V (its first
``kv_lora_rank`` values: ``attn_prefill``; the decode kernel takes V as wide as K and the rope part
of its output is dropped); for one token of one sequence the heads are spread over the engine's
pool. Shapes the kernels do not take (widths not a multiple of 16, large padding masks) run the
same arithmetic in torch.

Prompts of 128 tokens or more attend in the expanded form instead (``_expands``: fewer products
per query/key pair once the prompt is long): the cached latents are expanded through kv_b_proj for
the duration of the call, and the engine's prefill kernel runs over the per-head K/V. The cache is
the same latent rows either way.

Installed on CPU loads for the adapters that are ``MLAAdapter``s; training, autograd and a
cache written by transformers' own forward go to transformers' forward unchanged.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..formats import FormatError
from ..kernels.dispatch import engine_module
from ..runtime.engine_layout import engine_projection
from .adapters.base import MLAAdapter, MoEAdapter
from .cpu_attention import _KV_DTYPES, _engine_prefill, mask_plan

# For one query token the decode kernel's unit of work is one (batch row, KV head); MLA has one KV
# head, so the heads are split into this many groups (or the largest of 4, 2, 1 dividing them), each
# a work item of the engine's pool.
_DECODE_HEAD_GROUPS = 8
# Prompts of at least this many tokens attend in the expanded form (``_expands``), unless its K/V
# for the whole context would take more than _EXPANDED_MAX_BYTES.
_EXPANDED_MIN_TOKENS = 128
_EXPANDED_MAX_BYTES = 256 << 20


def weight_read_linears(adapter: MoEAdapter) -> tuple[str, ...]:
    """The attention's Linears whose weights this forward reads as tensors, not as calls: they stay
    torch Linears (dense_engine.py leaves them out)."""
    return ("kv_b_proj",) if isinstance(adapter, MLAAdapter) else ()


def install_mla(model: nn.Module, adapter: MoEAdapter) -> int:
    """Give each MLA attention module of ``model`` the absorbed forward; returns how many."""
    if not isinstance(adapter, MLAAdapter):
        return 0
    count = 0
    for module in model.modules():
        if hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_proj_with_mqa"):
            original = type(module).forward
            module.forward = types.MethodType(_make_forward(original, adapter), module)
            count += 1
    return count


def _make_forward(original: Any, adapter: MLAAdapter) -> Any:
    params = list(inspect.signature(original).parameters)[1:]  # V2 and V3 order their arguments differently

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        call = dict(zip(params, args, strict=False)) | kwargs
        if not _takes_absorbed(self, call):
            return original(self, *args, **kwargs)
        return mla_absorbed(
            self,
            adapter,
            call["hidden_states"],
            call.get("position_embeddings"),
            call.get("attention_mask"),
            call.get("cache", call.get("past_key_values")),
        )

    forward.hetmoe_mla = True  # type: ignore[attr-defined]
    return forward


def _takes_absorbed(attn: nn.Module, call: dict[str, Any]) -> bool:
    """Inference on the CPU with a plain kv_b_proj, and a cache that is empty or holds latent rows."""
    x = call.get("hidden_states")
    if attn.training or x is None or x.device.type != "cpu" or call.get("output_attentions"):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or attn.kv_b_proj.weight.requires_grad):
        return False
    if (
        type(attn.kv_b_proj) is not nn.Linear
        or attn.kv_b_proj.bias is not None
        or call.get("position_embeddings") is None
    ):
        return False
    cache = call.get("cache", call.get("past_key_values"))
    if cache is None:
        return True
    layers = getattr(cache, "layers", None)
    if layers is None or attn.layer_idx >= len(layers):
        return False
    layer = layers[attn.layer_idx]
    keys = getattr(layer, "keys", None)
    if not getattr(layer, "is_initialized", False) or keys is None or keys.numel() == 0:
        return True
    return keys.shape[-1] == attn.kv_lora_rank + attn.qk_rope_head_dim and layer.values.shape[-1] == 0


def mla_absorbed(
    attn: nn.Module,
    adapter: MLAAdapter,
    x: torch.Tensor,
    position_embeddings: Any,
    mask: torch.Tensor | None,
    cache: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' DeepseekV2/V3Attention forward, ``x [B, T, hidden]`` -> ``(out [B, T, hidden], None)``,
    with the latent cache and the absorbed products (module docstring)."""
    b, t, _ = x.shape
    heads, nope, rope_dim = attn.num_heads, attn.qk_nope_head_dim, attn.qk_rope_head_dim
    rank, v_dim = attn.kv_lora_rank, attn.v_head_dim
    q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(b, t, heads, nope + rope_dim).transpose(1, 2)
    q_nope, q_rot = torch.split(q, [nope, rope_dim], dim=-1)
    compressed = attn.kv_a_proj_with_mqa(x)
    latent, k_rot = torch.split(compressed, [rank, rope_dim], dim=-1)
    latent = attn.kv_a_layernorm(latent).view(b, 1, t, rank)
    k_rot = k_rot.view(b, 1, t, rope_dim)
    q_rot, k_rot = adapter.mla_rotary(attn, q_rot, k_rot, position_embeddings)
    rows = torch.cat((latent, k_rot.to(latent.dtype)), dim=-1)  # [B, 1, T, rank + rope]
    if cache is not None:
        rows, _ = cache.update(rows, rows.new_empty(b, 1, t, 0), attn.layer_idx)

    if _expands(attn, t, rows):
        return attn.o_proj(_expanded_prompt(attn, q_nope, q_rot, rows, mask).to(x.dtype)), None
    stored = stored_heads(attn) if b == 1 and t == 1 else None
    if stored is not None:  # one token, the file's attn_k_b / attn_v_b blocks (attach_stored_heads)
        q_lat = _stored_gemv(stored.uk, q_nope.reshape(heads, nope).float(), rank).view(1, heads, 1, rank)
        one = True
    else:
        w_uk_t, w_uv = _absorbed_weights(attn)
        one = b == 1 and t == 1 and w_uk_t.dtype == torch.bfloat16 and nope % 16 == 0 and rank % 16 == 0
        if one:  # one token: both per-head products in the engine's bf16 GEMV
            q_lat = _head_gemv(w_uk_t, q_nope.reshape(heads, nope).float()).view(1, heads, 1, rank)
        else:
            q_lat = torch.matmul(w_uk_t, q_nope.to(w_uk_t.dtype).transpose(-1, -2)).transpose(-1, -2).float()
    query = torch.cat((q_lat, q_rot.float()), dim=-1)  # [B, H, T, rank + rope]
    o_lat = _attend(query, rows, rank, mask, float(attn.scaling))  # [B, H, T, rank] fp32
    if stored is not None:
        out = _stored_gemv(stored.uv, o_lat[0, :, 0, :], v_dim)
    elif one:
        out = _head_gemv(w_uv, o_lat[0, :, 0, :])
    else:
        out = torch.matmul(w_uv, o_lat.to(w_uv.dtype).transpose(-1, -2)).permute(0, 3, 1, 2)  # [B, T, H, v]
    return attn.o_proj(out.reshape(b, t, heads * v_dim).to(x.dtype)), None


def _head_gemv(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``y[h] = w[h] @ x[h]`` for bf16 blocks ``w [H, N, K]`` (rows unit-strided; blocks and rows may
    lie apart, as W_UV's do inside kv_b_proj's weight) and fp32 ``x [H, K]`` (rows unit-strided, any
    row stride: the decode kernel's output rows, rope part after them) -> fp32 ``[H, N]``."""
    heads, n, k = w.shape
    y = torch.empty(heads, n)
    engine_module().head_gemv_bf16(
        w.data_ptr(), w.stride(0) * 2, w.stride(1) * 2, heads, n, k, x.data_ptr(), x.stride(0), y.data_ptr()
    )
    return y


def _stored_gemv(descriptor: tuple[int, ...], x: torch.Tensor, n: int) -> torch.Tensor:
    """``y[h] = W_h @ x[h]`` for blocks a projection ``descriptor`` holds with a head an expert (the
    file's attn_k_b or attn_v_b, ``stored_heads``), fp32 ``x [H, K]`` with unit-strided rows -> fp32
    ``[H, n]``: the engine's GEMV of the block type, each head's x quantized to int16 per 32."""
    heads = x.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = torch.empty(heads, n)
    engine_module().head_gemv(descriptor, heads, x.data_ptr(), x.stride(0), y.data_ptr())
    return y


def _expands(attn: nn.Module, t: int, rows: torch.Tensor) -> bool:
    """A long prompt attends in the expanded form (``_expanded_prompt``) where that costs less: per
    head and query/key pair the absorbed form multiplies ``2 rank + rope`` values (1088 at DeepSeek's
    512 + 64), the expanded one ``nope + rope + v`` (320) after expanding every cached row once
    (``rank x (nope + v)`` per row and head): cheaper from about 170 query tokens on, whatever the
    context. The expanded K/V exist only during the call; past _EXPANDED_MAX_BYTES it stays absorbed."""
    heads, length = attn.num_heads, rows.shape[2]
    k_dim, v_dim = attn.qk_nope_head_dim + attn.qk_rope_head_dim, attn.v_head_dim
    if t < _EXPANDED_MIN_TOKENS or rows.dtype not in _KV_DTYPES or k_dim % 16 or v_dim % 16:
        return False
    return rows.shape[0] * heads * length * (k_dim + v_dim) * rows.element_size() <= _EXPANDED_MAX_BYTES


def _expanded_prompt(
    attn: nn.Module, q_nope: torch.Tensor, q_rot: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """transformers' own arithmetic for a prompt: every cached latent expanded through kv_b_proj to
    per-head K ``[c W_UK | k_rope]`` and V ``c W_UV`` (in the model's dtype), then the engine's prefill
    kernel over them. Returns ``[B, T, H * v]`` fp32."""
    b, heads, t, _ = q_nope.shape
    length, rank, nope = rows.shape[2], attn.kv_lora_rank, attn.qk_nope_head_dim
    kv = attn.kv_b_proj(rows[:, 0, :, :rank]).view(b, length, heads, nope + attn.v_head_dim).transpose(1, 2)
    k_rope = rows[:, :, :, rank:].expand(b, heads, length, attn.qk_rope_head_dim)
    keys = torch.cat((kv[..., :nope], k_rope), dim=-1)
    values = kv[..., nope:]
    query = torch.cat((q_nope, q_rot), dim=-1).float()
    plan = _engine_plan(query, keys, values.shape[-1], mask)
    if plan is not None:
        return _engine_prefill(query, keys, values, plan, float(attn.scaling)).reshape(b, t, -1)
    return _torch_attention(query, keys, values, mask, float(attn.scaling)).transpose(1, 2).reshape(b, t, -1)


def _absorbed_weights(attn: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_UK^T [H, rank, nope], W_UV [H, v, rank])`` from kv_b_proj's weight: W_UV a view of it,
    W_UK^T a transposed copy made once (again if the weight is replaced, its storage swapped or its
    values changed in place), so that each head's product with the query is a GEMV over unit-strided
    rows. The copy is half of kv_b_proj's weight (DeepSeek-V3: 16 MiB a layer in bf16)."""
    weight = attn.kv_b_proj.weight
    cached = attn.__dict__.get("_hetmoe_absorbed")
    if cached is not None and cached[0] is weight and cached[3] == weight_state(weight):
        return cached[1], cached[2]
    heads, nope, v_dim = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    w = weight.detach().view(heads, nope + v_dim, attn.kv_lora_rank)
    w_uk_t = w[:, :nope, :].transpose(1, 2).contiguous()
    w_uv = w[:, nope:, :]
    attn._hetmoe_absorbed = (weight, w_uk_t, w_uv, weight_state(weight))
    return w_uk_t, w_uv


def weight_state(weight: torch.Tensor) -> tuple[int, int]:
    """Where a weight's values live and how often they were changed in place (an inference tensor
    keeps no counter: -1), to tell when a copy made from it is stale."""
    try:
        version = weight._version
    except RuntimeError:
        version = -1
    return weight.data_ptr(), version


def _attend(
    query: torch.Tensor, rows: torch.Tensor, rank: int, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """softmax(query rows^T * scale + mask) rows[..., :rank] for ``query [B, H, T, Dk]`` (fp32) over the
    cached ``rows [B, 1, L, Dk]``; a missing mask is causal, the queries being the last T rows."""
    b, t = query.shape[0], query.shape[2]
    values = rows[..., :rank]
    plan = _engine_plan(query, rows, rank, mask)
    if plan is not None:
        if b == 1 and t == 1 and plan[0] is None:
            return _engine_decode(query, rows, scale)[..., :rank]
        return _engine_prefill(query, rows, values, plan, scale).transpose(1, 2)
    return _torch_attention(query, rows, values, mask, scale)


def _torch_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """The same in torch, fp32: ``query [B, H, T, Dk]`` over ``keys [B, 1 or H, L, Dk]`` and ``values``
    -> ``[B, H, T, Dv]``; a missing mask is causal, the queries being the last T keys."""
    t, length = query.shape[2], keys.shape[2]
    scores = torch.matmul(query, keys.float().transpose(-1, -2)) * scale  # [B, H, T, L]
    if mask is None:
        visible = torch.arange(length).view(1, length) <= (length - t + torch.arange(t)).view(t, 1)
        scores = scores.masked_fill(~visible, float("-inf"))
    elif mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1), values.float())


def _engine_decode(query: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token of one sequence, ``query [1, H, 1, Dk]``, over every cached row, in the engine's
    decode kernel: it reads each key row once for a group of heads with no transposed copy (the
    prefill kernel's fp32 transpose of every key block costs more than the products for one token).
    The kernel's values are rows of Dk too, so the rope part of each output row is computed and then
    dropped (Dk - kv_lora_rank of Dk wasted: 11% at DeepSeek's 512 + 64). The heads are split into
    groups, each a work item over the same rows (a zero batch stride). Returns ``[1, H, 1, Dk]`` fp32."""
    h, dk = query.shape[1], query.shape[-1]
    groups = next(g for g in (_DECODE_HEAD_GROUPS, 4, 2, 1) if h % g == 0)
    q = query.reshape(groups, 1, h // groups, dk).contiguous()
    out = torch.empty_like(q)
    strides = (0, rows.stride(1), rows.stride(2))
    engine_module().attn_decode(
        q.data_ptr(),
        rows.data_ptr(),
        rows.data_ptr(),
        _KV_DTYPES[rows.dtype],
        groups,
        1,
        h // groups,
        rows.shape[2],
        dk,
        strides,
        strides,
        0,
        float(scale),
        out.data_ptr(),
    )
    return out.view(1, h, 1, dk)


def _engine_plan(
    query: torch.Tensor, rows: torch.Tensor, rank: int, mask: torch.Tensor | None
) -> tuple[torch.Tensor | None, bool] | None:
    """``(additive fp32 mask or None, causal)`` for the engine's kernel, or None where it does not take
    the call (then torch computes it)."""
    b, h, t, dk = query.shape
    if rows.dtype not in _KV_DTYPES or dk % 16 or rank % 16 or rows.stride(-1) != 1:
        return None
    if mask is None:
        return None, True
    return mask_plan(mask, b, h, t, rows.shape[2])


@dataclass(frozen=True)
class StoredHeads:
    """A latent-attention layer's W_UK^T and W_UV as its GGUF file stores them (attn_k_b, attn_v_b):
    the engine's descriptors of the two, a head an expert; the projections that keep their bytes
    alive; and the kv_b_proj weight (and its state) they stand in for."""

    uk: tuple[int, ...]
    uv: tuple[int, ...]
    keep: tuple[Any, ...]
    weight: torch.Tensor
    state: tuple[int, int]
    label: str  # what `hetmoe generate -v` names (models/paths.py)


def attach_stored_heads(model: nn.Module, source: Any) -> int:
    """Give each latent-attention layer of a GGUF load its file's attn_k_b and attn_v_b as stored (the
    GGUF source's ``stored_parts`` of kv_b_proj), for the one-token per-head products (``mla_absorbed``
    and mla_decode.py's engine block): W_UK^T and W_UV then read the file's blocks (Q4_0, Q8_0 ...: a
    quarter to a half of bf16's bytes, and the file's own values) instead of kv_b_proj's weight, which
    prompts still read. Kept only while kv_b_proj's weight is the one loaded (``stored_heads``).
    Returns how many layers have them."""
    count = 0
    for name, module in model.named_modules():
        kv_b = module._modules.get("kv_b_proj") if hasattr(module, "kv_lora_rank") else None
        if type(kv_b) is not nn.Linear:
            continue
        parts = source.stored_parts(f"{name}.kv_b_proj.weight")
        if parts is None or len(parts) != 2:  # kv_b_proj stored whole (older files) or in a float type
            continue
        heads, nope, rank, v_dim = module.num_heads, module.qk_nope_head_dim, module.kv_lora_rank, module.v_head_dim
        k_b, v_b = parts
        if tuple(k_b.shape) != (heads, rank, nope) or tuple(v_b.shape) != (heads, v_dim, rank):
            continue
        try:
            uk, uv = (engine_projection(q, n) for q, n in ((k_b, "attn_k_b"), (v_b, "attn_v_b")))
        except FormatError:  # widths the engine does not take (K not a multiple of 32 ...)
            continue
        if uk.note or uv.note:  # a block type the engine would transcode: not the file's bytes
            continue
        weight = kv_b.weight
        module._hetmoe_stored_heads = StoredHeads(
            uk.descriptor(rank, nope),
            uv.descriptor(v_dim, rank),
            (uk, uv),
            weight,
            weight_state(weight),
            f"attn_k_b {k_b.method}, attn_v_b {v_b.method}",
        )
        count += 1
    return count


def stored_heads(attn: nn.Module) -> StoredHeads | None:
    """The file's blocks for W_UK^T and W_UV (attach_stored_heads), where kv_b_proj still holds the
    weight they came with; else None (the bf16 blocks of kv_b_proj)."""
    stored = attn.__dict__.get("_hetmoe_stored_heads")
    if stored is None or attn.kv_b_proj.weight is not stored.weight or weight_state(stored.weight) != stored.state:
        return None
    return stored


__all__ = ["StoredHeads", "attach_stored_heads", "install_mla", "mla_absorbed", "stored_heads", "weight_read_linears"]
