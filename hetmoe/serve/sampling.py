"""Choosing the next token: greedy, or sampled with temperature, top-k, top-p and min-p, after a
repetition penalty and an n-gram ban.

Each request owns a ``torch.Generator`` (seeded from ``seed`` when given), so a seeded request
draws the same tokens whatever else is running in its batch. The steps apply in the order
transformers' ``generate`` applies its processors (the repetition penalty, the n-gram ban, then
temperature, top-k, top-p, min-p), so the distribution sampled from is the one ``generate`` would sample from.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters, already validated."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1): no top-k filter
    min_p: float = 0.0  # 0: no min-p filter
    repetition_penalty: float = 1.0  # 1: none
    no_repeat_ngram_size: int = 0  # n > 0: no n tokens in a row occur twice in the text
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


class SeenTokens:
    """The tokens a request's text holds (prompt and output), with a mask over the vocabulary that
    each new token updates in place: the repetition penalty reads it every step without walking the text."""

    def __init__(self, ids: Iterable[int] = ()) -> None:
        self.ids = set(ids)
        self._mask: torch.Tensor | None = None

    def add(self, token: int) -> None:
        self.ids.add(token)
        if self._mask is not None and 0 <= token < self._mask.numel():
            self._mask[token] = True

    def mask_for(self, logits: torch.Tensor) -> torch.Tensor:
        """The mask ``[V]`` for a row of logits ``[V]``; ids outside ``[0, V)`` are ignored, as in transformers."""
        vocab = logits.shape[-1]
        if self._mask is None or self._mask.numel() != vocab or self._mask.device != logits.device:
            ids = torch.tensor([i for i in self.ids if 0 <= i < vocab], dtype=torch.long)
            self._mask = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            self._mask[ids.to(logits.device)] = True
        return self._mask


class NGramBan:
    """transformers' ``no_repeat_ngram_size`` (NoRepeatNGramLogitsProcessor) for one request: no
    ``n`` tokens in a row may occur twice in the text (prompt and output). The (n-1)-token prefixes
    seen so far map to the tokens that followed them, grown a token at a time, so a step's banned
    tokens are one lookup of the text's last n-1 tokens."""

    def __init__(self, n: int, ids: Iterable[int] = ()) -> None:
        if n < 1:
            raise ValueError(f"no_repeat_ngram_size must be >= 1, got {n}")
        self.n = n
        self.text: list[int] = []
        self.followers: dict[tuple[int, ...], set[int]] = {}
        for token in ids:
            self.add(token)

    def add(self, token: int) -> None:
        self.text.append(token)
        if len(self.text) >= self.n:
            prefix = tuple(self.text[len(self.text) - self.n : -1])
            self.followers.setdefault(prefix, set()).add(token)

    def banned(self) -> list[int]:
        """The tokens that would end an n-gram the text already holds."""
        if len(self.text) < self.n - 1:
            return []
        prefix = tuple(self.text[len(self.text) - self.n + 1 :]) if self.n > 1 else ()
        return sorted(self.followers.get(prefix, ()))


def penalize_repetition(logits: torch.Tensor, seen: Iterable[int] | SeenTokens, penalty: float) -> torch.Tensor:
    """fp32 logits ``[V]`` with every token of ``seen`` (the prompt's and the output's) made less likely.

    The CTRL paper's rule, as transformers' RepetitionPenaltyLogitsProcessor and vLLM apply it: a
    seen token's logit is divided by ``penalty`` where positive and multiplied where negative, once
    however often it was seen. Ids outside ``[0, V)`` are ignored.
    """
    scores = logits.float()
    if penalty == 1.0:
        return scores
    mask = (seen if isinstance(seen, SeenTokens) else SeenTokens(seen)).mask_for(scores)
    return torch.where(mask, torch.where(scores > 0, scores / penalty, scores * penalty), scores)


def filter_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """fp32 logits ``[V]`` scaled by 1/temperature, with the tokens top-k, top-p and min-p drop set to -inf.

    top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p`` (always
    at least one token), as transformers' TopPLogitsWarper does; min-p then drops the tokens less
    likely than ``min_p`` times the most likely one (MinPLogitsWarper).
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
    if min_p > 0.0:
        # log(min_p * p_top) = log(min_p) + the top score's log-probability; the top token stays.
        logp = scores.log_softmax(-1)
        scores = scores.masked_fill(logp < logp.max() + math.log(min_p), float("-inf"))
    return scores


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
    seen: Iterable[int] | SeenTokens = (),
    ngrams: NGramBan | None = None,
) -> int:
    """The next token from one row of logits ``[V]``; ``seen`` (the prompt's and the output's tokens)
    feeds the repetition penalty and ``ngrams`` the n-gram ban, which apply to greedy decoding too,
    as in transformers (and vLLM, for the penalty)."""
    logits = penalize_repetition(logits, seen, params.repetition_penalty)
    banned = [t for t in ngrams.banned() if 0 <= t < logits.shape[-1]] if ngrams is not None else []
    if banned:
        logits = logits.index_fill(-1, torch.tensor(banned, device=logits.device), float("-inf"))
    if params.greedy:
        return int(torch.argmax(logits))
    scores = filter_logits(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
