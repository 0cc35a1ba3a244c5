"""The server's OpenAPI 3.1 document, served at ``/openapi.json``.

Request bodies are protocol.py's own models (the ones requests are validated by), narrowed where the
server refuses what the model would parse: ``n`` other than 1, presence and frequency penalties, logit_bias, logprobs,
tools, echo, suffix, best_of (check_supported), ``stream_options`` without ``stream`` and the one
model name served. Responses are described by the models below, the objects the app sends
(app.py's ``_Shape``), closed (``additionalProperties: false``), so a client or a schema fuzzer
(schemathesis, tests/test_serve_schema.py) can hold every answer to the document. A stream is
``text/event-stream`` of events whose data is a ``ChatCompletionChunk`` or ``CompletionChunk`` (JSON
Schema's ``contentSchema``, which schemathesis applies to each event), then ``[DONE]``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from .protocol import ChatCompletionRequest, CompletionRequest

FinishReason = Literal["stop", "length"]


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Closed):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Closed):
    error: ErrorDetail


class Usage(_Closed):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(_Closed):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Closed):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Closed):
    status: Literal["ok"]
    running: int
    waiting: int


class HealthDown(_Closed):
    status: Literal["error"]
    detail: str


class AssistantMessage(_Closed):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Closed):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: FinishReason


class ChatCompletion(_Closed):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChunkDelta(_Closed):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Closed):
    index: int
    delta: ChunkDelta
    logprobs: None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Closed):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # with stream_options.include_usage: null, then the last chunk's counts


class TextChoice(_Closed):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason


class TextCompletion(_Closed):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


class TextChunkChoice(_Closed):
    index: int
    text: str
    logprobs: None
    finish_reason: FinishReason | None


class CompletionChunk(_Closed):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChunkChoice]
    usage: Usage | None = None


_MODELS: list[type[BaseModel]] = [
    ErrorResponse,
    ModelList,
    ModelCard,
    Health,
    HealthDown,
    ChatCompletion,
    ChatCompletionChunk,
    TextCompletion,
    CompletionChunk,
]
_REQUESTS = {"ChatCompletionRequest": ChatCompletionRequest, "CompletionRequest": CompletionRequest}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


# What check_supported refuses, as the only values the document allows (the server answers 400 to
# anything else, as a negative case should get).
_NARROWED_BOTH = {
    "n": _nullable({"const": 1}),
    "presence_penalty": _nullable({"type": "number", "minimum": 0, "maximum": 0}),
    "frequency_penalty": _nullable({"type": "number", "minimum": 0, "maximum": 0}),
    "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
}
_NARROWED = {
    "ChatCompletionRequest": {
        "logprobs": _nullable({"const": False}),
        "top_logprobs": _nullable({"const": 0}),
        "tools": _nullable({"type": "array", "maxItems": 0}),
        "functions": _nullable({"type": "array", "maxItems": 0}),
        "response_format": _nullable(
            {"type": "object", "properties": {"type": {"const": "text"}}, "required": ["type"]}
        ),
    },
    "CompletionRequest": {
        "echo": {"const": False},
        "logprobs": {"type": "null"},
        "suffix": _nullable({"type": "string", "maxLength": 0}),
        "best_of": _nullable({"const": 1}),
    },
}
# stream_options only with stream: true (check_supported).
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def _request_schema(name: str, model_name: str, max_model_len: int) -> dict[str, Any]:
    schema = _REQUESTS[name].model_json_schema(ref_template="#/components/schemas/{model}")
    defs = schema.pop("$defs", {})
    props = schema["properties"]
    props["model"] = {"type": "string", "enum": [model_name]}
    for key in ("max_tokens", "max_completion_tokens"):
        if key in props:
            props[key] = _nullable({"type": "integer", "minimum": 1, "maximum": max_model_len})
    props.update(_NARROWED_BOTH)
    props.update(_NARROWED[name])
    schema.update(_STREAM_OPTIONS_NEED_STREAM)
    return {"schema": schema, "defs": defs}


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}


def _errors(*codes: int) -> dict[str, Any]:
    reasons = {
        400: "invalid request (the field, what was expected, what was found)",
        401: "missing or incorrect API key",
        404: "unknown model or path",
        413: "request body too large",
        429: "queue full",
        500: "the generation failed inside the worker (that request only)",
        503: "the generation worker is not running",
    }
    return {str(c): {"description": reasons[c], "content": _json("ErrorResponse")} for c in codes}


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream: its data a JSON ``chunk``, the final ``[DONE]``, or (as
    OpenAI's streams do when a generation fails after the 200 went out) an error body."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"const": "message"},
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": "application/json",
                        "contentSchema": {
                            "anyOf": [
                                {"$ref": f"#/components/schemas/{chunk}"},
                                {"$ref": "#/components/schemas/ErrorResponse"},
                            ]
                        },
                    },
                ]
            },
        },
    }


def _completion_op(summary: str, request: str, answer: str, chunk: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": _json(request)},
        "responses": {
            "200": {
                "description": f"the {answer}, or with stream: true a text/event-stream of {chunk} data lines"
                " ending in 'data: [DONE]'",
                "content": {**_json(answer), "text/event-stream": {"schema": _event(chunk)}},
            },
            **_errors(400, 404, 413, 429, 500, 503),
        },
    }


def openapi_document(model_name: str, max_model_len: int, api_key: bool) -> dict[str, Any]:
    """The document for a server of ``model_name`` (the only value its ``model`` fields take)."""
    _, top = models_json_schema([(m, "serialization") for m in _MODELS], ref_template="#/components/schemas/{model}")
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    for name in _REQUESTS:
        built = _request_schema(name, model_name, max_model_len)
        schemas.update(built["defs"])
        schemas[name] = built["schema"]
    security = [{"bearer": []}] if api_key else []
    models_op = {"responses": {"200": {"description": "the served model", "content": _json("ModelList")}}}
    model_op = {
        "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {"200": {"description": "the served model", "content": _json("ModelCard")}, **_errors(404)},
    }
    paths: dict[str, Any] = {
        "/health": {
            "get": {
                "security": [],
                "responses": {
                    "200": {"description": "serving", "content": _json("Health")},
                    "503": {
                        "description": "the generation worker is not running, or an expert rank is lost",
                        "content": _json("HealthDown"),
                    },
                },
            }
        },
        "/metrics": {
            "get": {
                "responses": {
                    "200": {
                        "description": "Prometheus text format",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                }
            }
        },
        "/v1/models": {"get": models_op},
        "/v1/models/{model_id}": {"get": model_op},
        "/v1/chat/completions": {
            "post": _completion_op(
                "a chat completion", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
            )
        },
        "/v1/completions": {
            "post": _completion_op("a text completion", "CompletionRequest", "TextCompletion", "CompletionChunk")
        },
    }
    if api_key:
        for path, item in paths.items():
            if path != "/health":  # the one route without the key
                for op in item.values():
                    op["responses"].update(_errors(401))
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "hetmoe", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas},
        "security": security,
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
