"""schemathesis against the server's own OpenAPI document (/openapi.json, hetmoe/serve/openapi.py):
generated requests to every operation, valid ones and invalid ones (positive and negative data),
streaming included, each answer checked for

- no 5xx (``not_a_server_error``),
- a status code, content type, headers and body the document declares for that operation
  (``status_code_conformance``, ``content_type_conformance``, ``response_headers_conformance``,
  ``response_schema_conformance``),
- a 4xx for every request the document rules out (``negative_data_rejection``),
- and, for a stream, every event's data a chunk of the declared model (the document's
  ``contentSchema``, and the pydantic model itself in ``_stream_conforms``), ``[DONE]`` last.

HETMOE_SCHEMA_EXAMPLES sets the examples per operation (default 25: the suite's bounded run, about
half a minute); a longer run is the same test with a larger number, or schemathesis' own command
against a running ``hetmoe serve`` (README).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("schemathesis")

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks as st_checks
from tiny_models import tiny_chat_model

from hetmoe.serve.app import build_app
from hetmoe.serve.background import BackgroundServer
from hetmoe.serve.openapi import ChatCompletionChunk, CompletionChunk
from hetmoe.serve.served_model import load_served_model

KEY = "schema-key-0123456789"
EXAMPLES = int(os.environ.get("HETMOE_SCHEMA_EXAMPLES", "25"))
MAX_MODEL_LEN = 48  # bounds every generation: a request with no max_tokens generates to the context's end

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(tiny_cache):
    served = load_served_model(tiny_chat_model(tiny_cache), name="tiny-chat", threads=1, max_model_len=MAX_MODEL_LEN)
    with BackgroundServer(build_app(served, api_key=KEY, max_batch=4, max_queue=64)) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"})


WITH_INPUT = [("GET", "/v1/models/{model_id}"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions")]
# Negative data only where there is an input to make invalid.
CASES = [(m, p, "positive") for m, p in [("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"), *WITH_INPUT]]
CASES += [(m, p, "negative") for m, p in WITH_INPUT]
CHECKS = [
    st_checks.not_a_server_error,
    st_checks.status_code_conformance,
    st_checks.content_type_conformance,
    st_checks.response_headers_conformance,
    st_checks.response_schema_conformance,
    st_checks.negative_data_rejection,
]


def _stream_conforms(path: str, response) -> None:
    """Every event a chunk of the operation's model, and ``[DONE]``, where it came, the last one.
    (schemathesis reads a stream up to a number of events or a time and checks those against the
    document; this holds them to the pydantic models themselves.)"""
    chunk_model = ChatCompletionChunk if path == "/v1/chat/completions" else CompletionChunk
    lines = [line for line in response.text.split("\n") if line]
    assert lines, "an empty stream"
    for i, line in enumerate(lines):
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        if data == "[DONE]":
            assert i == len(lines) - 1, lines[i:]
        else:
            body = json.loads(data)
            assert "error" not in body, body  # a generation that failed: a server error after the 200
            chunk_model.model_validate(body)


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_every_answer_is_what_the_document_declares(api_schema, method: str, path: str, mode: str) -> None:
    """Hypothesis drives schemathesis' strategy for the operation directly (its pytest plugin does not
    load under pytest 9): EXAMPLES cases, the same ones every run (derandomized)."""
    operation = api_schema[path][method]
    strategy = operation.as_strategy(schemathesis.GenerationMode(mode))
    seen = {"cases": 0, "stream": 0, "2xx": 0, "4xx": 0}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(case=strategy)
    def one(case) -> None:
        response = case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"}, checks=CHECKS)
        seen["cases"] += 1
        seen[f"{response.status_code // 100}xx"] = seen.get(f"{response.status_code // 100}xx", 0) + 1
        content_type = response.headers.get("content-type", [""])[0]
        if response.status_code == 200 and content_type.startswith("text/event-stream"):
            seen["stream"] += 1
            _stream_conforms(path, response)

    one()
    print(f"{method} {path} {mode}: {seen}")  # the figures a longer run reports (pytest -s)


def test_the_document_names_the_served_model_and_what_is_refused(server) -> None:
    import httpx

    doc = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["model"] == {"type": "string", "enum": ["tiny-chat"]}
    assert chat["n"] == {"anyOf": [{"const": 1}, {"type": "null"}]}
    assert set(doc["paths"]) == {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/models/{model_id}",
        "/v1/chat/completions",
        "/v1/completions",
    }
    assert httpx.get(server.url + "/openapi.json", timeout=10).status_code == 401  # behind the key
