"""Top-k routing functions shared by several architectures.

Each mirrors, operation for operation and dtype for dtype, what the transformers router of the
architectures that use it computes, so that hetmoe picks the same experts with the same weights
bit for bit (a different rounding order could flip a near-tie and send a token elsewhere). Inputs
are router logits ``[T, E]``; outputs are ``(weights [T, k], ids [T, k])``.
"""

from __future__ import annotations

import torch


def softmax_topk(
    logits: torch.Tensor, k: int, normalize: bool, out_dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in fp32, top-k, optional renormalisation (Qwen, OLMoE, Mixtral).

    ``out_dtype``: the dtype the weights are cast to afterwards (the logits' for Qwen and OLMoE),
    None to keep fp32 (Mixtral).
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        top /= top.sum(dim=-1, keepdim=True)
    return (top if out_dtype is None else top.to(out_dtype)), ids


def group_mask(scores: torch.Tensor, n_group: int, topk_group: int, group_scores: torch.Tensor) -> torch.Tensor:
    """Bool ``[T, E]``: experts in the ``topk_group`` best of ``n_group`` equal groups."""
    e = scores.shape[-1]
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores)
    mask.scatter_(1, chosen, 1)
    return mask.unsqueeze(-1).expand(-1, n_group, e // n_group).reshape(-1, e).bool()


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / Kimi-K2 / GLM-4-MoE: sigmoid scores, choice by score + correction bias within
    the best groups (a group's score: the sum of its two best), weights from the unbiased scores."""
    scores = logits.sigmoid()
    for_choice = scores + bias
    e = scores.shape[-1]
    group_scores = for_choice.view(-1, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    allowed = group_mask(scores, n_group, topk_group, group_scores)
    for_choice = for_choice.masked_fill(~allowed, float("-inf"))
    ids = torch.topk(for_choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
    return weights * scaling, ids


def softmax_group_limited_topk(
    logits: torch.Tensor, k: int, method: str, n_group: int | None, topk_group: int | None, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax scores, top-k overall (``greedy``) or within the ``topk_group`` groups
    with the highest single score (``group_limited_greedy``), scaled, not renormalised."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if method == "group_limited_greedy":
        assert n_group and topk_group
        e = scores.shape[-1]
        group_scores = scores.view(-1, n_group, e // n_group).max(dim=-1).values
        scores = scores.masked_fill(~group_mask(scores, n_group, topk_group, group_scores), 0.0)
    elif method != "greedy":
        raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
    return weights * scaling, ids


def sigmoid_biased_topk(logits: torch.Tensor, bias: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M2: sigmoid scores in fp32, choice by score + correction bias, renormalised weights."""
    scores = torch.sigmoid(logits.float())
    ids = torch.topk(scores + bias, k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def topk_softmax(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: top-k of the logits first, softmax over the k chosen, in the logits' dtype."""
    top, ids = torch.topk(logits, k, dim=-1)
    return torch.softmax(top, dim=1, dtype=top.dtype), ids
