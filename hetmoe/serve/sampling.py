"""Choosing the next token: greedy, or sampled with temperature, top-k and top-p.

Each request owns a ``torch.Generator`` (seeded from ``seed`` when given), so a seeded request
draws the same tokens whatever else is running in its batch. The filters apply in the order
transformers' ``generate`` applies its warpers (temperature, then top-k, then top-p), so the
distribution sampled from is the one ``generate`` would sample from.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters, already validated."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k filter
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator of its own for one request: ``seed`` (any int64/uint64) or a random one."""
    g = torch.Generator(device=device)
    g.manual_seed(seed % 2**64 if seed is not None else secrets.randbits(63))
    return g


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp32 logits ``[V]`` scaled by 1/temperature, with the tokens top-k and top-p drop set to -inf.

    top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p`` (always
    at least one token), as transformers' TopPLogitsWarper does.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
    # Shifted so the top score is 0 (softmax does not change), then divided in float64: the API
    # allows any temperature above 0, down to 5e-324, which in fp32 is 0 (0 / 0 is NaN) and below
    # ~1e-38 makes the scores overflow to inf (softmax NaN). This way the top token scores 0 and the
    # others -inf in the limit: it takes all the mass.
    scores = logits.float()
    scores = ((scores - scores.max()).double() / temperature).float()
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        probs = sorted_scores.softmax(-1)
        # A token goes when the tokens ranked above it already reach top_p.
        mass_before = probs.cumsum(-1) - probs
        drop_sorted = mass_before >= top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """The next token from one row of logits ``[V]``."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = filter_logits(logits, params.temperature, params.top_k, params.top_p)
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
