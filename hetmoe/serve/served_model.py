"""The model a server answers for: the hetmoe-loaded model, its tokenizer, limits and defaults.

Two tokenizer instances are kept: the HTTP side encodes prompts on the event-loop thread while the
worker thread decodes generated tokens, and a Rust tokenizer shared between threads can fail with
"Already borrowed" when one thread changes its settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models.generation_config import read_generation_config
from ..models.tokenizer import model_files_dir
from .protocol import ApiError, ChatMessage


@dataclass
class SamplingDefaults:
    """What a request that leaves a parameter out gets: the model's generation_config.json, else OpenAI's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0


@dataclass
class ServedModel:
    name: str
    model: Any
    tokenizer: Any  # the HTTP side: chat template and prompt encoding
    worker_tokenizer: Any  # the worker thread: decoding
    max_model_len: int
    eos_ids: frozenset[int]
    vocab_size: int
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    created: int = field(default_factory=lambda: int(time.time()))

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        """The chat template applied with the assistant's turn opened, as token ids."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, f"model {self.name!r} has no chat template: use /v1/completions", param="messages")
        conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # the template's own raise_exception (e.g. roles out of order), jinja errors
            raise ApiError(400, f"messages: the chat template refused them: {exc}", param="messages") from None
        # The template already wrote any BOS and special tokens.
        return self.encode(text, special=False)

    def encode(self, text: str, special: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def check_ids(self, ids: list[int]) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            message = f"prompt: token id {bad} is outside the vocabulary [0, {self.vocab_size})"
            raise ApiError(400, message, param="prompt")


def load_served_model(
    path: str | Path,
    *,
    name: str | None = None,
    method: str | None = None,
    device: str = "cpu",
    threads: int | None = None,
    max_model_len: int | None = None,
    dtype: str | None = None,
    gpu_experts: int = 0,
    expert_parallel: int | None = None,
    expert_placement: str = "id",
    routing_stats: str | None = None,
    dist_init_method: str | None = None,
    dist_rank: int | None = None,
) -> ServedModel:
    """Load ``path`` with :func:`hetmoe.load_model` and its tokenizer; a clear ValueError for what is missing."""
    from ..models.loader import load_model
    from ..models.tokenizer import load_tokenizer

    directory = Path(path)
    tokenizer = load_tokenizer(directory, "serving")
    worker_tokenizer = load_tokenizer(directory, "serving")
    model = load_model(  # under expert parallelism, only rank 0 returns (models/expert_parallel_load.py)
        directory,
        method=method,
        device=device,
        cpu_threads=threads,
        dtype=dtype,
        gpu_experts=gpu_experts,
        expert_parallel=expert_parallel,
        expert_placement=expert_placement,
        routing_stats=routing_stats,
        dist_init_method=dist_init_method,
        dist_rank=dist_rank,
    )
    config = model.config
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    if max_model_len is None:
        if limit <= 0:
            raise ValueError(f"{directory}: the config has no max_position_embeddings; pass --max-model-len")
        max_model_len = limit
    if max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {max_model_len}")
    if limit > 0 and max_model_len > limit:
        raise ValueError(
            f"--max-model-len {max_model_len} is more than the model's max_position_embeddings {limit} "
            "(positions it was never trained on)"
        )
    return ServedModel(
        name=name or directory.name,
        model=model,
        tokenizer=tokenizer,
        worker_tokenizer=worker_tokenizer,
        max_model_len=max_model_len,
        eos_ids=_eos_ids(model, tokenizer),
        vocab_size=int(config.vocab_size),
        defaults=_sampling_defaults(model_files_dir(directory)),
    )


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """End-of-sequence ids: the generation config's (an int or a list) and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _sampling_defaults(directory: Path) -> SamplingDefaults:
    """The sampling values generation_config.json spells out (vLLM's rule), else OpenAI's defaults; a
    value out of range is the loader's CheckpointError (models/generation_config.py), not ignored."""
    raw = read_generation_config(directory) or {}
    defaults = SamplingDefaults()
    for key in ("temperature", "top_p", "min_p", "repetition_penalty"):
        if raw.get(key) is not None:
            setattr(defaults, key, float(raw[key]))
    for key in ("top_k", "no_repeat_ngram_size"):
        if raw.get(key) is not None:
            setattr(defaults, key, int(raw[key]))
    return defaults
