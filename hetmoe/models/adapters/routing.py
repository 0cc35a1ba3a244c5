"""Top-k routing functions shared by several architectures.

Each mirrors, operation for operation and dtype for dtype, what the transformers router of the
architectures that use it computes, so that hetmoe picks the same experts with the same weights
bit for bit (a different rounding order could flip a near-tie and send a token elsewhere). The
exceptions are the routers on CPU logits without autograd: the engine computes them (csrc/routing.h:
``softmax_topk``, gpt-oss's ``topk_softmax``, and the grouped and biased sigmoid routers), each weight
rounded once from its exact value and equal values ordered as torch.topk orders them, because a
one-call decode layer routes with it in C++ and every path of a layer must route alike (and one
engine call costs less than the ten torch ops of a grouped router). Inputs are router logits
``[T, E]``; outputs are ``(weights [T, k], ids [T, k])``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, fp32: bool = False
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as the architecture's router computes it, in its output dtype;
    ``fp32``: the router computes in fp32 from fp32 casts of x and the weight (DeepSeek).

    On the CPU a bf16 router runs as a bf16 linear in the CPU engine (made once, and again only if
    the weight changes): torch's bf16 GEMM on a CPU without bf16 instructions took ~90 us a layer
    for one token against a Qwen3-30B-A3B router (128 x 2048), and an fp32 copy of the weight, twice
    the bytes to read each step, ~100 us inside the model; the engine streams the bf16 weight. Like
    a bf16 GEMM it accumulates in fp32 and rounds once, so the logits differ from torch's at most in
    the order of the fp32 sum. Other routers take the product in fp32 from an fp32 copy of the
    weight made once (fp32 routers no longer convert their weight on every call).
    """
    if fp32:
        x = x.float()
    if x.device.type != "cpu" or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return (
            F.linear(x, weight.float(), None if bias is None else bias.float()) if fp32 else F.linear(x, weight, bias)
        )
    out_dtype = torch.float32 if fp32 else torch.promote_types(x.dtype, weight.dtype)
    if bias is not None and not fp32:
        out_dtype = torch.promote_types(out_dtype, bias.dtype)
    engine = engine_linear(weight, bias)
    if engine is not None:
        y = engine.forward(x.float())  # a direct call: a decode step routes in every layer
    elif fp32_router_in_engine(weight, bias):
        y = _fp32_router(x.float(), weight)
    else:
        y = F.linear(x.float(), _fp32_copy(weight), None if bias is None else _fp32_copy(bias))
    return y if out_dtype == torch.float32 else y.to(out_dtype)


def fp32_router_in_engine(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``router_logits`` computes an fp32 router (DeepSeek's: transformers keeps its weight in
    fp32) in the engine (csrc/routing.h: router_logits_f32, what the one-call latent-attention layer
    computes it with): an fp32 ``[E, H]`` CPU weight, H a multiple of 16, no bias."""
    if bias is not None or weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 16:
        return False
    return weight.device.type == "cpu" and weight.is_contiguous() and _engine_for(weight, torch.float32) is not None


def _fp32_router(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    flat = x.reshape(-1, cols).contiguous()
    y = torch.empty(*x.shape[:-1], rows, dtype=torch.float32)
    engine = _engine_for(weight, torch.float32)
    engine.router_logits_f32(weight.data_ptr(), rows, cols, flat.data_ptr(), flat.shape[0], y.data_ptr())
    return y


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


def engine_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module | None:
    """A bf16 CPULinear of a bf16 ``weight [E, H]`` (cached on it), or None where the engine cannot run it."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 32:
        return None
    key = (_version(weight), None if bias is None else (id(bias), _version(bias)))
    cached = getattr(weight, "_hetmoe_engine", None)
    if cached is None or cached[0] != key:
        from ...runtime.cpu_linear import CPULinear  # runtime sits below models; lazily, to keep import order simple

        try:
            linear = CPULinear(weight.detach(), None if bias is None else bias.detach(), method="bf16")
        except (ImportError, RuntimeError, ValueError):  # no engine on this machine: torch's fp32 path
            linear = None
        cached = (key, linear)
        weight._hetmoe_engine = cached  # lives and dies with the weight
    return cached[1]


def _fp32_copy(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t
    version = _version(t)
    cached = getattr(t, "_hetmoe_fp32", None)
    if cached is None or cached[0] != version:
        cached = (version, t.detach().float())
        t._hetmoe_fp32 = cached  # lives and dies with the weight
    return cached[1]


def softmax_topk(
    logits: torch.Tensor, k: int, normalize: bool, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, top-k, optional renormalisation (Qwen, OLMoE, Mixtral).

    ``out_dtype``: the dtype the weights are cast to afterwards (the logits' for Qwen and OLMoE),
    None to keep fp32 (Mixtral).

    CPU logits without autograd are routed by the engine (csrc/routing.h), as the one-call decode
    layer routes them (models/fast_decode.py), so that a layer routes alike whichever path runs it:
    each weight within one fp32 rounding of the exact value (torch's vectorised exp and its
    multiply-by-reciprocal are a few ulps off it, tests/test_hybrid.py), the experts those torch.topk
    picks, equal logits included. Elsewhere, torch's own ops.
    """
    engine = _engine_for(logits, out_dtype)
    if engine is not None:
        experts = logits.shape[-1]
        rows = logits.numel() // experts
        flat = logits.contiguous()
        ids = torch.empty(*logits.shape[:-1], k, dtype=torch.int64)
        weights = torch.empty(*logits.shape[:-1], k, dtype=torch.float32)
        bf16 = flat.dtype == torch.bfloat16
        engine.softmax_topk(flat.data_ptr(), int(bf16), rows, experts, k, normalize, out_dtype == torch.bfloat16,
                            ids.data_ptr(), weights.data_ptr())  # fmt: skip
        return (weights if out_dtype in (None, torch.float32) else weights.to(out_dtype)), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        top /= top.sum(dim=-1, keepdim=True)
    return (top if out_dtype is None else top.to(out_dtype)), ids


def _engine_for(logits: torch.Tensor, out_dtype: torch.dtype | None) -> Any:
    """The engine module where it routes these logits (softmax_topk's engine path), else None."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.bfloat16, torch.float32) or not logits.numel():
        return None
    if out_dtype not in (None, torch.float32, torch.bfloat16) or (torch.is_grad_enabled() and logits.requires_grad):
        return None
    from ...kernels.dispatch import EngineUnavailableError, engine_module  # lazily, as engine_linear does

    try:
        return engine_module()
    except EngineUnavailableError:
        return None


def group_mask(scores: torch.Tensor, n_group: int, topk_group: int, group_scores: torch.Tensor) -> torch.Tensor:
    """Bool ``[T, E]``: experts in the ``topk_group`` best of ``n_group`` equal groups."""
    e = scores.shape[-1]
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores)
    mask.scatter_(1, chosen, 1)
    return mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e).bool()


@dataclass(frozen=True)
class GroupedTopk:
    """A grouped router's choice (csrc/routing.h: GroupedTopk): scores by sigmoid (else softmax over
    the row), choice by score + bias (where the block has one) among the ``topk_group`` best of
    ``n_group`` equal groups, a group scored by its largest choice value (``group_by_max``, DeepSeek-V2)
    or its two largest summed (V3); experts outside them masked to 0 (``masked_zero``: V2, which
    weighs by the masked scores) or -inf (V3, by the unmasked ones); the k weights divided by their
    sum plus ``eps`` where ``normalize``, then multiplied by ``scaling``."""

    k: int
    sigmoid: bool = True
    n_group: int = 1
    topk_group: int = 1
    group_by_max: bool = False
    masked_zero: bool = False
    normalize: bool = False
    eps: float = 0.0
    scaling: float = 1.0


@dataclass(slots=True, eq=False)  # not frozen: a decode step makes one a layer, and a frozen one takes 3x as long
class BlockRouting:
    """A MoE block's routing and shared experts, in the terms the one-call decode layer runs them in
    the engine (csrc/decode_step.h). The routing is a function of the logits ``router_logits``
    computes from the block's router (``fp32``: in fp32 from fp32 casts, DeepSeek and GLM; else in
    the router's dtype): softmax top-k (``softmax``: k, normalize, the weights rounded to the logits'
    dtype: routing's ``softmax_topk``), or a grouped router (``grouped``, with the block's correction
    ``bias`` or None). The shared experts are what the adapter's ``shared`` adds: a SwiGLU MLP module,
    scaled by the sigmoid of ``shared_gate``'s logit where the block has one (Qwen2-MoE)."""

    softmax: tuple[int, bool, bool] | None = None
    grouped: GroupedTopk | None = None
    bias: torch.Tensor | None = None
    fp32: bool = False
    shared: nn.Module | None = None
    shared_gate: nn.Module | None = None


def grouped_topk(
    logits: torch.Tensor, spec: GroupedTopk, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights fp32 [T, k], ids [T, k])`` of ``spec`` from ``logits [T, E]``. On CPU fp32 logits
    without autograd the engine's (csrc/routing.h: grouped_topk): the same ids in the same order as
    the torch version below takes (torch.topk's own algorithm on the same fp32 choice values), each
    weight rounded once from its exact value (torch's ops are a few ulps off it)."""
    e = logits.shape[-1]
    limited = spec.topk_group < spec.n_group
    if limited and (e % spec.n_group or (not spec.group_by_max and e // spec.n_group < 2)):
        raise ValueError(f"{e} experts in {spec.n_group} groups: equal groups, of two or more scored by their two best")
    routed = _grouped_in_engine(logits, spec, bias)
    if routed is not None:
        return routed
    scores = logits.softmax(dim=-1, dtype=torch.float32) if not spec.sigmoid else logits.sigmoid()
    for_choice = scores if bias is None else scores + bias
    if limited:
        grouped = for_choice.view(-1, spec.n_group, e // spec.n_group)
        group_scores = grouped.max(dim=-1).values if spec.group_by_max else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        allowed = group_mask(scores, spec.n_group, spec.topk_group, group_scores)
        for_choice = for_choice.masked_fill(~allowed, 0.0 if spec.masked_zero else float("-inf"))
        if spec.masked_zero:
            scores = for_choice  # V2: the choice values are the masked scores, and its weights
    ids = torch.topk(for_choice, k=spec.k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if spec.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.eps)
    return weights * spec.scaling, ids


def _grouped_in_engine(
    logits: torch.Tensor, spec: GroupedTopk, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """grouped_topk's engine path where it routes these logits: CPU fp32 ``[T, E]`` without
    autograd, the bias (if any) an ``[E]`` tensor on the CPU; else None."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or (bias is not None and bias.device.type != "cpu"):
        return None
    engine = _engine_for(logits, torch.float32)
    if engine is None or (bias is not None and torch.is_grad_enabled() and bias.requires_grad):
        return None
    rows, experts = logits.shape
    b = None if bias is None else _fp32_copy(bias).contiguous()
    if b is not None and b.shape != (experts,):
        return None
    flat = logits.contiguous()
    ids = torch.empty(rows, spec.k, dtype=torch.int64)
    weights = torch.empty(rows, spec.k, dtype=torch.float32)
    engine.grouped_topk(flat.data_ptr(), rows, experts, spec.k, spec.sigmoid, 0 if b is None else b.data_ptr(),
                        spec.n_group, spec.topk_group, spec.group_by_max, spec.masked_zero, spec.normalize, spec.eps,
                        spec.scaling, ids.data_ptr(), weights.data_ptr())  # fmt: skip
    return weights, ids


def v3_grouped(
    k: int, n_group: int, topk_group: int, normalize: bool, scaling: float, softmax: bool = False
) -> GroupedTopk:
    """DeepSeek-V3 / Kimi-K2 / GLM-4-MoE: sigmoid scores (softmax scores for ``softmax``: a GGUF
    whose metadata names no gating function, run as llama.cpp runs it), choice by score + correction
    bias within the best groups (a group's score: the sum of its two best), weights from the
    unbiased scores, renormalised with transformers' 1e-20 where ``normalize``."""
    return GroupedTopk(k, not softmax, n_group, topk_group, False, False, normalize, 1e-20, scaling)


def v2_grouped(
    k: int, method: str, n_group: int | None, topk_group: int | None, scaling: float, renormalize: bool = False
) -> GroupedTopk:
    """DeepSeek-V2: softmax scores, top-k overall (``greedy``) or within the ``topk_group`` groups
    with the highest single score (``group_limited_greedy``), scaled; not renormalised unless
    ``renormalize`` (llama.cpp's expert_weights_norm: the k weights divided by their sum, then scaled)."""
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    groups, kept = (n_group, topk_group) if method == "group_limited_greedy" else (1, 1)
    assert groups and kept
    return GroupedTopk(k, False, groups, kept, True, True, renormalize, 0.0, scaling)


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: top-k of the logits first, softmax over the k chosen, in the logits' dtype. Where the
    engine routes these logits, softmax_topk's engine path: the same experts, and weights that are
    the same numbers (the softmax of the k largest is the renormalised top k of the softmax) each
    rounded once."""
    if _engine_for(logits, logits.dtype) is not None:
        return softmax_topk(logits, k, True, logits.dtype)
    top, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), ids
