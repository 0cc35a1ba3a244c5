"""A model's generation_config.json: read, checked field by field, and the ranges of the sampling
values that hetmoe's samplers (transformers' generate for ``hetmoe generate``, serve/sampling.py for
the server) accept.

A field that generation compares or indexes with is checked here, so a broken file is one
CheckpointError naming it instead of transformers' multi-line OSError or a failure mid-generation.
The CLI's flags take the same ranges; the server's request fields take them too, within OpenAI's
narrower ones where it has them (temperature up to 2).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointError
from ..checkpoint.config import read_json_object

# The repetition penalties accepted: beyond these a seen token's logit (divided or multiplied by the
# penalty) is scaled by more than 100x, which no useful setting does (1.05-1.3 is usual); vLLM takes
# any penalty > 0, transformers any > 0 as well.
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 10.0

_INTS = ("max_new_tokens", "max_length", "min_length", "min_new_tokens", "num_beams", "top_k", "no_repeat_ngram_size")
_FLOATS = ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty", "length_penalty")
_TOKENS = ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")
# The sampling values' ranges, as (low, high, whether low itself is allowed).
_RANGES: dict[str, tuple[float, float, bool]] = {
    "temperature": (0.0, math.inf, True),
    "top_p": (0.0, 1.0, False),
    "min_p": (0.0, 1.0, True),
    "repetition_penalty": (REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX, True),
}


def _range_problem(key: str, value: float) -> str | None:
    """What is wrong with a sampling value (temperature, top_p, min_p, repetition_penalty), or None."""
    if key not in _RANGES:
        return None
    low, high, low_ok = _RANGES[key]
    if (value >= low if low_ok else value > low) and value <= high:
        return None
    left = "[" if low_ok else "("
    return f"must be in {left}{low:g}, {high:g}]" if math.isfinite(high) else f"must be >= {low:g}"


def field_problem(key: str, value: Any) -> str | None:
    """What is wrong with one generation_config.json field that generation compares or indexes with
    (None: nothing, or not one of those fields); null means unset, as transformers reads it."""
    if value is None:
        return None

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if key in _INTS and not (is_int(value) and value >= 0):
        return "must be a non-negative integer"
    if key in _FLOATS:
        if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            return "must be a number"
        if not math.isfinite(value):
            return "must be finite"
        return _range_problem(key, value)
    if key in _TOKENS:
        ids = value if isinstance(value, list) else [value]
        if not ids or not all(is_int(v) and v >= 0 for v in ids):
            return "must be a token id or a list of token ids"
    return None


def read_generation_config(directory: Path) -> dict[str, Any] | None:
    """The checked fields of ``directory``/generation_config.json, or None where there is no file."""
    path = directory / "generation_config.json"
    if not path.exists():
        return None
    raw = read_json_object(path)
    for key, value in raw.items():
        problem = field_problem(key, value)
        if problem:
            raise CheckpointError(path, f"{key} {problem}, found {value!r}")
    return raw


def load_generation_config(model: Any, directory: Path) -> None:
    """Set ``model.generation_config`` from the model's generation_config.json, where it has one; a
    file that is not a JSON object of valid generation settings is one CheckpointError naming it."""
    raw = read_generation_config(directory)
    if raw is None:
        return
    from transformers import GenerationConfig

    try:
        model.generation_config = GenerationConfig.from_dict(raw)  # its __init__ validates
    except (ValueError, TypeError, AttributeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        path = directory / "generation_config.json"
        raise CheckpointError(path, f"is not a valid generation config: {first}") from None
