"""The OpenAI wire format: request models, their validation, and OpenAI-shaped error bodies.

Requests are validated strictly (a string is not a number, ``true`` is not an integer, NaN is not
JSON) and every problem becomes an :class:`ApiError` naming the field, what was expected and what
was found; the app turns it into ``{"error": {"message", "type", "param", "code"}}`` with a 4xx
status. Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send newer
parameters keep working; known parameters this server cannot honour (``n`` > 1, logprobs, tools,
presence and frequency penalties, logit_bias, ...) are refused with a 400 rather than silently
ignored; vLLM's ``min_p`` and ``repetition_penalty`` and transformers' ``no_repeat_ngram_size`` are
taken.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ..models.generation_config import REPETITION_PENALTY_MAX, REPETITION_PENALTY_MIN

MAX_STOP_STRINGS = 16
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class ApiError(Exception):
    """An error answered as an OpenAI error body with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --- field types -----------------------------------------------------------------------------------

PositiveInt = Annotated[StrictInt, Field(ge=1)]
Temperature = Annotated[StrictFloat, Field(ge=0.0, le=2.0)]
TopP = Annotated[StrictFloat, Field(gt=0.0, le=1.0)]
TopK = Annotated[StrictInt, Field(ge=-1)]
MinP = Annotated[StrictFloat, Field(ge=0.0, le=1.0)]
# Above 1 discourages what was seen, below 1 encourages it (models/generation_config.py says why the bounds).
RepetitionPenalty = Annotated[StrictFloat, Field(ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX)]
NGramSize = Annotated[StrictInt, Field(ge=0, le=64)]
Seed = Annotated[StrictInt, Field(ge=SEED_MIN, le=SEED_MAX)]
StopString = Annotated[StrictStr, Field(min_length=1)]
Stop = StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _SamplingRequest(_Strict):
    """The fields both endpoints share."""

    model: StrictStr
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # not in OpenAI's API; vLLM's spelling. -1 or 0: off
    min_p: MinP | None = None  # vLLM's extension; 0: off
    repetition_penalty: RepetitionPenalty | None = None  # vLLM's extension; 1: off
    no_repeat_ngram_size: NGramSize | None = None  # transformers' generate option; 0: off
    seed: Seed | None = None
    stop: Stop | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # vLLM's extension: generate max_tokens tokens whatever the model says
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_SamplingRequest):
    prompt: (
        StrictStr
        | TokenIds
        | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=1)]
    )
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def prompt_value(self) -> str | list[int]:
        """The one prompt: a string or token ids (a list of one of either is unwrapped)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]  # type: ignore[return-value]
        return p  # type: ignore[return-value]


# --- parsing ---------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object; malformed JSON, NaN/Infinity, deep nesting or a non-object: 400."""
    if not body.strip():
        raise ApiError(400, "the request body is empty: expected a JSON object", code="invalid_json")
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse", code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, invalid UTF-8, NaN
        raise ApiError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, found {type(data).__name__}", code="invalid_json")
    return data


def _describe(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def validate(model: type[_SamplingRequest], data: dict[str, Any]) -> Any:
    """``model`` from ``data``; the first problem as a 400 naming the field, expected and found."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        # A union reports one error per alternative; the first is about the field as a whole.
        err = errors[0]
        loc = [str(p) for p in err["loc"] if not _is_union_tag(p)]
        param = ".".join(loc) or None
        found = "missing" if err["type"] == "missing" else _describe(err.get("input"))
        message = f"{param or 'body'}: {err['msg']} (found {found})"
        raise ApiError(400, message, param=param, code="invalid_value") from None


def _is_union_tag(part: Any) -> bool:
    """pydantic names the union member it tried (``str``, ``list[...]``, ``constrained-int``) in ``loc``."""
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or "[" in part or part.startswith(("constrained", "function"))
    )


def check_supported(req: _SamplingRequest) -> None:
    """Refuse parameters whose meaning this server does not implement (a 400 naming each)."""
    if req.n is not None and req.n != 1:
        raise ApiError(400, f"n: only n=1 is supported (found {req.n})", param="n", code="unsupported_value")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only allowed with stream=true", param="stream_options")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value not in (None, 0, 0.0):
            raise ApiError(400, f"{name}: not supported (found {value}; expected 0)", param=name)
    if req.logit_bias:
        raise ApiError(400, "logit_bias: not supported", param="logit_bias", code="unsupported_value")
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs or req.top_logprobs:
            raise ApiError(400, "logprobs: not supported", param="logprobs", code="unsupported_value")
        for name in ("tools", "functions"):
            if getattr(req, name):
                raise ApiError(400, f"{name}: tool calling is not supported", param=name, code="unsupported_value")
        if req.response_format is not None and req.response_format.get("type") != "text":
            found = _describe(req.response_format.get("type"))
            message = f"response_format: only type 'text' is supported (found {found})"
            raise ApiError(400, message, param="response_format")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "echo: not supported", param="echo", code="unsupported_value")
        if req.logprobs is not None:
            raise ApiError(400, "logprobs: not supported", param="logprobs", code="unsupported_value")
        if req.suffix:
            raise ApiError(400, "suffix: not supported", param="suffix", code="unsupported_value")
        if req.best_of not in (None, 1):
            raise ApiError(400, f"best_of: only 1 is supported (found {req.best_of})", param="best_of")
