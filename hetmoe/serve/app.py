"""The FastAPI app: OpenAI's chat and text completion endpoints over the continuous-batching scheduler.

Every route answers errors as OpenAI error bodies, never a bare 500: bodies over the size limit
get 413, malformed or invalid requests 400 naming the field (protocol.py), an unknown model 404, a
full queue 429, a stopped worker 503, and a failure inside the worker 500 for that request only.
An API key, when set, is checked in constant time on every route except ``/health``. A client that
goes away (a closed stream, or a dropped connection while a non-streamed answer is computed)
cancels its generation, which frees its batch slot and cache at the next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import fields
from functools import wraps
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .metrics import Metrics
from .openapi import openapi_document
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_supported,
    error_body,
    parse_json,
    validate,
)
from .ragged_attention import use_ragged_attention
from .sampling import SamplingParams
from .scheduler import Delta, Event, Failed, Finished, QueueFull, Scheduler, SchedulerStopped, Sequence
from .served_model import ServedModel

MAX_BODY_BYTES = 1 << 20
_DRAIN_LIMIT = 16 << 20  # an oversized body is read (and dropped) up to here so the client sees the 413
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ENDPOINTS = ("/health", "/metrics", "/openapi.json", "/v1/models", "/v1/chat/completions", "/v1/completions")


def build_app(
    served: ServedModel,
    *,
    api_key: str | None = None,
    max_batch: int = 32,
    max_queue: int = 256,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    """The whole server for ``served``: metrics, a scheduler (started and stopped with the app), the routes."""
    metrics = Metrics()
    # Batch-invariant decode attention where the model uses SDPA (ragged_attention.py).
    ragged = use_ragged_attention(served.model)
    scheduler = Scheduler(
        served.model,
        served.worker_tokenizer,
        served.eos_ids,
        max_batch=max_batch,
        max_queue=max_queue,
        metrics=metrics,
    )
    app = create_app(served, scheduler, metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    app.state.ragged_attention = ragged
    return app


def create_app(
    served: ServedModel,
    scheduler: Scheduler,
    metrics: Metrics,
    *,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
) -> FastAPI:
    if api_key is not None and not api_key:
        raise ValueError("the API key is empty: give a non-empty key, or none to serve without one")
    _add_runtime_gauges(metrics, scheduler, served)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="hetmoe", version="1", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served
    app.state.scheduler = scheduler
    app.state.metrics = metrics
    app.add_middleware(_Gate, api_key=api_key, metrics=metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(error_body(message, "invalid_request_error", None, code), status_code=exc.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not scheduler.alive:
            return JSONResponse({"status": "error", "detail": "the generation worker is not running"}, 503)
        if scheduler.broken:
            return JSONResponse({"status": "error", "detail": scheduler.broken}, 503)
        return JSONResponse({"status": "ok", "running": scheduler.running, "waiting": scheduler.waiting})

    document = openapi_document(served.name, served.max_model_len, api_key is not None)

    @app.get("/openapi.json")
    async def openapi_route() -> JSONResponse:
        return JSONResponse(document)

    @app.get("/metrics")
    async def metrics_route() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {
            "id": served.name,
            "object": "model",
            "created": served.created,
            "owned_by": "hetmoe",
            "max_model_len": served.max_model_len,
        }

    @app.get("/v1/models")
    @_api
    async def list_models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    @_api
    async def get_model(request: Request) -> JSONResponse:
        _check_model(served, request.path_params["model_id"])
        return JSONResponse(model_card())

    @app.post("/v1/chat/completions")
    @_api
    async def chat_completions(request: Request) -> Response:
        req = validate(ChatCompletionRequest, parse_json(await _read_body(request, max_body_bytes)))
        check_supported(req)
        _check_model(served, req.model)
        prompt = served.chat_prompt(req.messages)
        params = _sampling(served, req, prompt, req.completion_limit(), default_max=None)
        return await _generate(request, scheduler, served, "chat", req, prompt, params)

    @app.post("/v1/completions")
    @_api
    async def completions(request: Request) -> Response:
        req = validate(CompletionRequest, parse_json(await _read_body(request, max_body_bytes)))
        check_supported(req)
        _check_model(served, req.model)
        value = req.prompt_value()
        prompt = served.encode(value) if isinstance(value, str) else list(value)
        served.check_ids(prompt)
        params = _sampling(served, req, prompt, req.max_tokens, default_max=COMPLETIONS_DEFAULT_MAX_TOKENS)
        return await _generate(request, scheduler, served, "completion", req, prompt, params)

    return app


# --- request handling ------------------------------------------------------------------------------


def _api(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Answer ApiError, and anything unexpected, as an OpenAI error body."""

    @wraps(handler)
    async def wrapper(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except Exception as exc:
            message = f"internal error: {type(exc).__name__}: {exc}"
            return JSONResponse(error_body(message, "server_error", None, "internal_error"), status_code=500)

    return wrapper


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes; a larger one is read on (up to a cap, not kept) and refused with 413."""
    declared = request.headers.get("content-length")
    declared_size = int(declared) if declared is not None and declared.isdigit() else 0
    chunks: list[bytes] = []
    size = 0
    if declared_size <= _DRAIN_LIMIT:
        # Reading an oversized body to its end lets the client finish sending and read the 413.
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit and declared_size <= limit:
                chunks.append(chunk)
            elif size > _DRAIN_LIMIT:
                break
    size = max(size, declared_size)
    if size > limit:
        raise ApiError(413, f"the request body is {size} bytes; the limit is {limit} bytes", code="request_too_large")
    return b"".join(chunks)


def _check_model(served: ServedModel, name: str) -> None:
    if name != served.name:
        raise ApiError(
            404,
            f"model: {name!r} is not served here (this server serves {served.name!r})",
            param="model",
            code="model_not_found",
        )


def _sampling(
    served: ServedModel, req: Any, prompt: list[int], max_tokens: int | None, default_max: int | None
) -> SamplingParams:
    if not prompt:
        raise ApiError(400, "the prompt is empty (it tokenizes to no tokens)", param="prompt")
    limit, used = served.max_model_len, len(prompt)
    if used >= limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens, and the prompt alone is {used} tokens",
            param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = limit - used if default_max is None else min(default_max, limit - used)
    elif used + max_tokens > limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens; you requested {used + max_tokens} "
            f"({used} in the prompt, {max_tokens} to generate)",
            param="max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens",
            code="context_length_exceeded",
        )
    # Each sampling value the request leaves out is the model's (generation_config.json, as vLLM).
    values = {f.name: getattr(served.defaults, f.name) for f in fields(served.defaults)}
    values.update({k: v for k in values if (v := getattr(req, k)) is not None})
    values["top_k"] = max(0, values["top_k"])  # -1 (vLLM's "off") is 0 here
    return SamplingParams(
        max_tokens=max_tokens,
        **values,
        seed=req.seed,
        stop=req.stop_strings(),
        ignore_eos=req.ignore_eos,
    )


class _Events:
    """The worker's events for one request, delivered onto the event loop's queue."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()

    def sink(self, event: Event) -> None:  # called on the worker thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


async def _generate(
    request: Request,
    scheduler: Scheduler,
    served: ServedModel,
    kind: str,
    req: Any,
    prompt: list[int],
    params: SamplingParams,
) -> Response:
    events = _Events()
    seq = Sequence(prompt, params, events.sink)
    try:
        scheduler.submit(seq)
    except QueueFull as exc:
        message = f"the server is busy: {exc}; retry later"
        raise ApiError(429, message, type="rate_limit_error", code="queue_full") from None
    except SchedulerStopped as exc:
        raise ApiError(503, str(exc), type="server_error", code="unavailable") from None
    rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    shape = _Shape(kind, rid, served.name)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        stream = _stream(scheduler, seq, events, shape, usage)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    return await _collect(request, scheduler, seq, events, shape)


class _Shape:
    """OpenAI's response objects for one request."""

    def __init__(self, kind: str, rid: str, model: str) -> None:
        self.kind, self.id, self.model, self.created = kind, rid, model, int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, text: str | None, finish: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": usage}

    def final(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        if self.kind == "chat":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            return {**self._envelope("chat.completion", [choice]), "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._envelope("text_completion", [choice]), "usage": usage}


def _usage(done: Finished) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(
    scheduler: Scheduler, seq: Sequence, events: _Events, shape: _Shape, include_usage: bool
) -> AsyncIterator[str]:
    def with_usage(chunk: dict[str, Any]) -> dict[str, Any]:
        return {**chunk, "usage": None} if include_usage else chunk

    try:
        if shape.kind == "chat":
            yield _sse(with_usage(shape.chunk("", role=True)))
        while True:
            event = await events.queue.get()
            if isinstance(event, Delta):
                yield _sse(with_usage(shape.chunk(event.text)))
            elif isinstance(event, Finished):
                yield _sse(with_usage(shape.chunk(None if shape.kind == "chat" else "", finish=event.reason)))
                if include_usage:
                    yield _sse(shape.usage_chunk(_usage(event)))
                break
            else:
                yield _sse(error_body(event.message, "server_error", None, "generation_failed"))
                break
        yield "data: [DONE]\n\n"
    finally:
        # Runs when the client disconnects too (Starlette cancels the stream): free the slot.
        scheduler.cancel(seq)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(request: Request, scheduler: Scheduler, seq: Sequence, events: _Events, shape: _Shape) -> Response:
    parts: list[str] = []
    gone = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        while True:
            nxt = asyncio.ensure_future(events.queue.get())
            done, _ = await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:
                nxt.cancel()
                scheduler.cancel(seq)
                return Response(status_code=499)  # nobody is listening any more
            event = nxt.result()
            if isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Finished):
                return JSONResponse(shape.final("".join(parts), event.reason, _usage(event)))
            elif isinstance(event, Failed):
                return JSONResponse(error_body(event.message, "server_error", None, "generation_failed"), 500)
    finally:
        gone.cancel()
        scheduler.cancel(seq)


# --- authentication and request counting -----------------------------------------------------------


class _Gate:
    """Pure ASGI (streams pass through untouched): the API key check, and requests counted by endpoint and status."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.metrics = metrics

    def _authorized(self, scope: Scope) -> bool:
        assert self.key is not None
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # compare_digest: the time taken does not reveal how much of the key matched.
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")
        status = {"code": 500}

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        try:
            if self.key is not None and path != "/health" and not self._authorized(scope):
                body = error_body(
                    "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
                response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            with self.metrics.lock:
                self.metrics.requests.inc(endpoint=endpoint, status=str(status["code"]))


def _cached_bytes() -> float:
    from ..kernels.dispatch import engine_module

    return float(sum(engine_module().buffer_cache_stats()["blocks"]))


def _add_runtime_gauges(metrics: Metrics, scheduler: Scheduler, served: ServedModel) -> None:
    metrics.add_gauge("queue_depth", "Requests waiting for a batch slot.", lambda: scheduler.waiting)
    metrics.add_gauge("running_requests", "Requests admitted and not finished.", lambda: scheduler.running)
    metrics.add_gauge("max_batch", "The most requests one decode step runs.", lambda: scheduler.max_batch)
    metrics.add_gauge(
        "engine_buffer_cache_bytes", "Job buffers the CPU engine keeps for reuse (csrc/engine_common.h).", _cached_bytes
    )
    runtime = getattr(served.model, "hetmoe", None)
    if runtime is None or not hasattr(runtime, "timing"):
        return

    def timing(field: str) -> Callable[[], float]:
        return lambda: float(getattr(runtime.timing, field))

    metrics.add_gauge(
        "cpu_expert_seconds_total", "MoE layers' CPU-expert time, submit to result.", timing("cpu_s"), counter=True
    )
    metrics.add_gauge(
        "cpu_expert_wait_seconds_total", "Time blocked waiting for the CPU experts.", timing("wait_s"), counter=True
    )
    metrics.add_gauge("moe_seconds_total", "Time in MoE blocks.", timing("moe_s"), counter=True)
    metrics.add_gauge("moe_tokens_total", "Tokens through the MoE blocks (per layer).", timing("tokens"), counter=True)
