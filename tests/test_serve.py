"""The real server (uvicorn on a free 127.0.0.1 port) driven by the official ``openai`` client.

References are independent of the server: transformers' greedy ``generate`` on a separately
loaded copy of the model (hetmoe's ``load_model``, as ``hetmoe generate`` runs it) and the
tokenizer's own chat template and counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")

import httpx
import openai
from conftest import devices
from serve_process import serve_process
from tiny_models import tiny_chat_model

from hetmoe import load_model
from hetmoe.serve.app import build_app
from hetmoe.serve.background import BackgroundServer
from hetmoe.serve.served_model import load_served_model

KEY = "test-key-0123456789"
NAME = "tiny-chat"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BATCH, MAX_QUEUE = 8, 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_cache) -> Path:
    return tiny_chat_model(tiny_cache)


@pytest.fixture(scope="module")
def server(model_dir):
    served = load_served_model(model_dir, name=NAME, threads=1)
    app = build_app(served, api_key=KEY, max_batch=MAX_BATCH, max_queue=MAX_QUEUE)
    with BackgroundServer(app) as srv:
        srv.app = app
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy generation on an independently loaded model: ``(text, completion tokens, finish reason)``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model(model_dir, cpu_threads=1)
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def run(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False, **options: Any) -> tuple[str, int, str]:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt_ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=[] if ignore_eos else eos,
                pad_token_id=tok.pad_token_id,
                **options,
            )
        new = out[0, len(prompt_ids) :].tolist()
        reason = "length"
        if not ignore_eos and eos in new:
            new, reason = new[: new.index(eos) + 1], "stop"
        return tok.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False), len(new), reason

    run.tokenizer = tok  # type: ignore[attr-defined]
    return run


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)


def metrics(server) -> str:
    r = httpx.get(server.url + "/metrics", headers=AUTH, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = "^" + re.escape(name + (f"{{{want}}}" if want else "")) + r" (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def wait_for(server, name: str, predicate, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = metric(metrics(server), name)
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} stayed at {value}")
        time.sleep(0.02)


def messages_for(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a test."}, {"role": "user", "content": text}]


# --- the basics -------------------------------------------------------------------------------------


def test_lists_the_model_and_health_needs_no_key(server, client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    health = httpx.get(server.url + "/health", timeout=10)  # no key
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_api_key_rejected_and_accepted(server) -> None:
    for key in ("wrong-key", KEY[:-1], KEY + "x"):
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.models.list()
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    no_header = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x"}, timeout=10)
    assert no_header.status_code == 401 and no_header.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 401
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data[0].id == NAME


def test_chat_equals_greedy_generate_streamed_and_not(client, reference) -> None:
    msgs = messages_for("Hello, how are you today?")
    prompt = chat_ids(reference.tokenizer, msgs)
    want, n_tokens, reason = reference(prompt, 24)
    assert want  # the tiny model says something

    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.model == NAME
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), n_tokens)
    assert r.usage.total_tokens == len(prompt) + n_tokens

    stream = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(prompt)
    assert chunks[-1].usage.completion_tokens == n_tokens
    assert all(c.usage is None for c in chunks[:-1])

    # max_completion_tokens is the newer spelling of max_tokens
    r = client.chat.completions.create(model=NAME, messages=msgs, max_completion_tokens=5, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert want.startswith(r.choices[0].message.content)


@pytest.mark.parametrize("device", devices())
def test_serves_with_the_model_on_a_device_and_experts_there_too(model_dir, reference, device: str) -> None:
    """The non-expert layers and two experts a layer on ``device``, the rest in the CPU engine: the
    greedy chat answer, streamed and not, is generate's on a copy loaded the same way (the same
    device, so the same arithmetic)."""
    tok = reference.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    msgs = messages_for("Hello, how are you today?")
    prompt = chat_ids(tok, msgs)
    copy = load_model(model_dir, cpu_threads=1, device=device, gpu_experts=2)
    with torch.inference_mode():
        out = copy.generate(
            torch.tensor([prompt], device=copy.device),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=tok.pad_token_id,
        )
    new = out[0, len(prompt) :].tolist()
    want = tok.decode(
        new[: new.index(eos) + 1] if eos in new else new, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    served = load_served_model(model_dir, name=NAME, threads=1, device=device, gpu_experts=2)
    with BackgroundServer(build_app(served, api_key=KEY, max_batch=4, max_queue=4)) as srv:
        cli = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        r = cli.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == want
        stream = cli.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_the_worker_trims_the_heap_between_steps(client, monkeypatch) -> None:
    """The scheduler hands freed heap pages back every TRIM_EVERY_S (the soak's flat RSS depends on
    it): with the period at 0, a request's steps each call it."""
    from hetmoe.serve import scheduler as scheduler_module

    calls: list[float] = []
    monkeypatch.setattr(scheduler_module, "TRIM_EVERY_S", 0.0)
    monkeypatch.setattr(scheduler_module, "release_freed_memory", lambda: calls.append(time.monotonic()))
    r = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 4
    # Each pass of the worker's loop prefills what it admitted, runs one decode step, then trims: the
    # prefill's pass gives tokens 1 and 2, two more passes tokens 3 and 4. The last pass trims after
    # its token went out, maybe after this answer arrived: the first two have trimmed by now.
    assert len(calls) >= 2


def test_completions_stop_strings_across_token_boundaries(client, reference) -> None:
    tok = reference.tokenizer
    prompt_text = "The quick brown fox"
    prompt = tok(prompt_text, add_special_tokens=False)["input_ids"]
    full, n, _ = reference(prompt, 30, ignore_eos=True)
    r = client.completions.create(
        model=NAME, prompt=prompt_text, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == full and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n
    assert r.usage.prompt_tokens == len(prompt)

    # A stop string made of the end of one generated token and the start of the next.
    with torch.inference_mode():
        ids = (
            load_model(Path(tok.name_or_path), cpu_threads=1)
            .generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=[], pad_token_id=0)[
                0, len(prompt) :
            ]
            .tolist()
        )
    pieces = [tok.decode([t]) for t in ids]
    stop, at = None, 0
    for i in range(len(pieces) - 1):
        a, b = pieces[i], pieces[i + 1]
        at += len(a)
        if a.strip() and b.strip() and "\ufffd" not in a + b:
            candidate = a[-2:] + b[:2]
            if full.find(candidate) == at - len(a[-2:]):
                stop = candidate
                break
    assert stop is not None, pieces
    want = full[: full.find(stop)]
    for use_stream in (False, True):
        kwargs = {"model": NAME, "prompt": prompt_text, "max_tokens": 30, "temperature": 0, "stop": [stop, "@@@@"]}
        if use_stream:
            chunks = list(client.completions.create(stream=True, extra_body={"ignore_eos": True}, **kwargs))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(extra_body={"ignore_eos": True}, **kwargs)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == want and reason == "stop", (stop, text, want)


def test_sampling_with_a_seed_is_reproducible(client) -> None:
    kwargs = {"model": NAME, "prompt": "Numbers: 1 2 3", "max_tokens": 12, "temperature": 1.0, "top_p": 0.9}
    kwargs["extra_body"] = {"top_k": 50, "ignore_eos": True}
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kwargs).choices[0].text for s in range(5)}
    assert len(others) > 1  # the seed matters


def test_repetition_penalty_equals_transformers_generate(client, reference) -> None:
    """vLLM's repetition_penalty field, on greedy decoding: the same tokens as generate's processor."""
    tok = reference.tokenizer
    prompt = "Numbers: 1 2 3 1 2 3 1 2 3"
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    plain, _, _ = reference(ids, 16, ignore_eos=True)
    # The first penalty that changes this completion, so the comparison below can fail: which does
    # depends on the random model's logits in this machine's arithmetic (1.8 does on the CI machines,
    # not on an AMX Xeon with torch 2.11).
    penalized = ((p, reference(ids, 16, ignore_eos=True, repetition_penalty=p)[0]) for p in (1.8, 4.0, 16.0))
    penalty, want = next(((p, text) for p, text in penalized if text != plain), (None, plain))
    assert penalty is not None, "no repetition penalty changes the reference's completion"
    kwargs = {"model": NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0}
    r = client.completions.create(extra_body={"ignore_eos": True, "repetition_penalty": penalty}, **kwargs)
    assert r.choices[0].text == want
    # transformers' n-gram ban, greedy: the same tokens as generate's processor.
    banned, _, _ = reference(ids, 16, ignore_eos=True, no_repeat_ngram_size=2)
    assert banned != plain
    body = {"ignore_eos": True, "no_repeat_ngram_size": 2}
    assert client.completions.create(extra_body=body, **kwargs).choices[0].text == banned
    # min_p = 1 keeps only the most likely token (ties aside): sampling hot then gives greedy's text,
    # which the same seed without min_p does not.
    hot = {"model": NAME, "prompt": prompt, "max_tokens": 16, "temperature": 1.5, "seed": 5}
    with_min_p = client.completions.create(extra_body={"ignore_eos": True, "min_p": 1.0}, **hot)
    without = client.completions.create(extra_body={"ignore_eos": True}, **hot)
    assert with_min_p.choices[0].text == plain != without.choices[0].text


# --- batching ---------------------------------------------------------------------------------------

CONCURRENT = [
    ("Hello there", 16),
    ("What is the capital of France? Tell me, please, in detail.", 6),
    ("x", 16),
    ("Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000", 10),
    ("Café, naïve, über 🙂", 16),
    ("def main():", 4),
    ("The quick brown fox jumps over the lazy dog.", 12),
    ("Mixture-of-experts models route every token to a few experts.", 16),
]


def test_eight_concurrent_streams_are_batched_and_each_equals_its_unbatched_answer(server, reference) -> None:
    tok = reference.tokenizer
    expected = [reference(chat_ids(tok, messages_for(text)), n)[0] for text, n in CONCURRENT]
    before = metrics(server)
    steps0 = metric(before, "hetmoe_decode_batch_size_count")
    single0 = metric(before, "hetmoe_decode_batch_size_bucket", le="1")

    async def one(aclient, text: str, n: int) -> str:
        stream = await aclient.chat.completions.create(
            model=NAME, messages=messages_for(text), max_tokens=n, temperature=0, stream=True
        )
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return "".join(parts)

    async def main() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        async with aclient:
            first = [asyncio.create_task(one(aclient, t, n)) for t, n in CONCURRENT[:4]]
            await asyncio.sleep(0.05)  # the rest join a batch that is already decoding
            rest = [asyncio.create_task(one(aclient, t, n)) for t, n in CONCURRENT[4:]]
            return await asyncio.gather(*first, *rest)

    got = asyncio.run(main())
    assert got == expected
    after = metrics(server)
    steps = metric(after, "hetmoe_decode_batch_size_count") - steps0
    single = metric(after, "hetmoe_decode_batch_size_bucket", le="1") - single0
    assert steps > 0 and steps - single > 0, "no decode step ran more than one request"
    # batched: far fewer forwards than tokens
    assert steps < sum(n for _, n in CONCURRENT) - len(CONCURRENT)
    assert metric(after, "hetmoe_running_requests") == 0


# --- disconnects and the queue ----------------------------------------------------------------------


def _long_chat(text: str) -> dict[str, Any]:
    return {
        "model": NAME,
        "messages": messages_for(text),
        "max_tokens": 1900,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }


def test_full_queue_is_429_and_closed_streams_free_their_slots(server, client) -> None:
    m0 = metrics(server)
    cancelled0 = metric(m0, "hetmoe_requests_cancelled_total")
    tokens0 = metric(m0, "hetmoe_generation_tokens_total")
    with contextlib.ExitStack() as streams:
        http = streams.enter_context(httpx.Client(base_url=server.url, headers=AUTH, timeout=30))
        running = []
        for i in range(MAX_BATCH):
            r = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=_long_chat(f"long {i}")))
            assert r.status_code == 200
            running.append(r)
        wait_for(server, "hetmoe_running_requests", lambda v: v == MAX_BATCH)
        for i in range(MAX_QUEUE):
            r = streams.enter_context(http.stream("POST", "/v1/chat/completions", json=_long_chat(f"queued {i}")))
            assert r.status_code == 200
        assert metric(metrics(server), "hetmoe_queue_depth") == MAX_QUEUE
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(model=NAME, messages=messages_for("one too many"), max_tokens=2)
        assert err.value.status_code == 429 and err.value.body["code"] == "queue_full"
        busy = http.post("/v1/completions", json={"model": NAME, "prompt": "x"})
        assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
        # the running streams are producing text; then every client goes away
        data = next(line for line in running[0].iter_lines() if '"content":"' in line and '"content":""' not in line)
        assert data.startswith("data: {")
    wait_for(server, "hetmoe_running_requests", lambda v: v == 0)
    m1 = metrics(server)
    assert metric(m1, "hetmoe_queue_depth") == 0
    assert metric(m1, "hetmoe_requests_cancelled_total") - cancelled0 == MAX_BATCH + MAX_QUEUE
    assert metric(m1, "hetmoe_generation_tokens_total") - tokens0 < MAX_BATCH * 1900 / 2  # stopped early
    assert metric(m1, "hetmoe_requests_total", endpoint="/v1/chat/completions", status="429") >= 1


def test_disconnects_cancel_streamed_and_unstreamed_generations(server, client) -> None:
    m0 = metrics(server)
    cancelled0 = metric(m0, "hetmoe_requests_cancelled_total")
    tokens0 = metric(m0, "hetmoe_generation_tokens_total")
    # streamed: read two chunks, then close the stream
    stream = client.chat.completions.create(
        model=NAME,
        messages=messages_for("tell me everything"),
        max_tokens=1900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    next(it), next(it)
    assert metric(metrics(server), "hetmoe_running_requests") == 1
    stream.close()
    wait_for(server, "hetmoe_running_requests", lambda v: v == 0)
    # not streamed: the client times out and drops the connection while the answer is computed
    body = {**_long_chat("and again"), "stream": False}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=0.5)
    wait_for(server, "hetmoe_running_requests", lambda v: v == 0)
    m1 = metrics(server)
    assert metric(m1, "hetmoe_requests_cancelled_total") - cancelled0 == 2
    assert metric(m1, "hetmoe_generation_tokens_total") - tokens0 < 1900


# --- bad requests and failures ----------------------------------------------------------------------

MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS: list[tuple[str, str, Any, int, str | None]] = [
    # (method, path, body: dict -> JSON, bytes -> raw, expected status, expected param)
    ("POST", "/v1/chat/completions", b"{not json", 400, None),
    ("POST", "/v1/chat/completions", b"[1, 2]", 400, None),
    ("POST", "/v1/chat/completions", b"", 400, None),
    ("POST", "/v1/chat/completions", b'{"model": "tiny-chat", "messages": [], "temperature": NaN}', 400, None),
    ("POST", "/v1/chat/completions", b"[" * 50000 + b"]" * 50000, 400, None),
    ("POST", "/v1/chat/completions", {"messages": MSG}, 400, "model"),
    ("POST", "/v1/chat/completions", {"model": NAME}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": 5}]}, 400, None),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": "hi"}, 400, "messages"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "max_tokens": -5}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "max_tokens": "10"}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "max_tokens": 10**12}, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "temperature": -1}, 400, "temperature"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "top_p": 0}, 400, "top_p"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "top_p": 1.5}, 400, "top_p"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "n": 2}, 400, "n"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "stop": [""]}, 400, "stop"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "stop": 5}, 400, "stop"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "seed": "x"}, 400, "seed"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "stream": "yes"}, 400, "stream"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "logprobs": True}, 400, "logprobs"),
    ("POST", "/v1/chat/completions", {"model": NAME, "messages": MSG, "stream_options": {}}, 400, "stream_options"),
    ("POST", "/v1/chat/completions", {"model": "gpt-4", "messages": MSG}, 404, "model"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": [10**6]}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": []}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": ""}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "hi " * 3000}, 400, "prompt"),
    ("POST", "/v1/completions", {"model": NAME, "prompt": "hi", "echo": True}, 400, "echo"),
    ("POST", "/v1/completions", b'{"model": "tiny-chat", "prompt": "' + b"a" * (1 << 20) + b'"}', 413, None),
    ("GET", "/v1/chat/completions", None, 405, None),
    ("GET", "/v1/nothing-here", None, 404, None),
    ("GET", "/v1/models/gpt-4", None, 404, "model"),
]


def test_malformed_requests_get_4xx_json_errors_and_the_server_keeps_serving(server, client, reference) -> None:
    assert len(BAD_REQUESTS) >= 15
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for method, path, body, status, param in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.request(method, path, json=body)
            assert r.status_code == status, (path, body if not isinstance(body, bytes) else body[:60], r.text[:300])
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
            if param is not None:
                assert error["param"] is not None and error["param"].startswith(param), (body, error)
    assert metric(metrics(server), "hetmoe_requests_failed_total") == 0
    msgs = messages_for("Still there?")
    want = reference(chat_ids(reference.tokenizer, msgs), 8)[0]
    assert (
        client.chat.completions.create(model=NAME, messages=msgs, max_tokens=8, temperature=0)
        .choices[0]
        .message.content
        == want
    )


def test_a_failure_inside_the_worker_fails_only_that_request(server, client, reference, monkeypatch) -> None:
    model = server.app.state.served.model
    forward = model.forward
    poison = 444
    fail_next_decode = threading.Event()

    def flaky(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1 and poison in ids[0].tolist():
            raise RuntimeError("poisoned prompt")
        if ids.shape[1] == 1 and fail_next_decode.is_set():
            fail_next_decode.clear()
            raise RuntimeError("a decode step broke")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", flaky)
    msgs = messages_for("Hello there")
    want = reference(chat_ids(reference.tokenizer, msgs), 40, ignore_eos=True)[0]
    healthy = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=40, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(healthy)
    parts = [next(it).choices[0].delta.content]
    with pytest.raises(openai.InternalServerError) as err:  # prefill of the poisoned prompt fails, alone
        client.completions.create(model=NAME, prompt=[5, poison, 6], max_tokens=3)
    assert "poisoned prompt" in err.value.body["message"] and err.value.body["type"] == "server_error"
    parts += [c.choices[0].delta.content or "" for c in it]
    assert "".join(parts) == want

    # A failed decode step fails the requests of that step; the worker serves the next ones. The
    # step is the request's first decode step (set before it starts: set after its first chunk, a
    # fast machine could finish all 50 tokens before the flag was seen).
    fail_next_decode.set()
    stream = client.completions.create(
        model=NAME, prompt="abc", max_tokens=50, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    it = iter(stream)
    next(it)  # the token of the prefill
    with pytest.raises(openai.APIError, match="a decode step broke"):
        list(it)
    assert metric(metrics(server), "hetmoe_requests_failed_total") == 2
    monkeypatch.undo()
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    r = client.chat.completions.create(
        model=NAME, messages=msgs, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].message.content == want
    assert metric(metrics(server), "hetmoe_running_requests") == 0


def test_metrics_report_requests_tokens_latencies_and_cpu_expert_time(server) -> None:
    text = metrics(server)
    assert metric(text, "hetmoe_requests_total", endpoint="/v1/chat/completions", status="200") > 5
    assert metric(text, "hetmoe_requests_total", endpoint="/v1/completions", status="400") > 0
    assert metric(text, "hetmoe_requests_total", endpoint="/v1/chat/completions", status="401") == 0
    assert metric(text, "hetmoe_prompt_tokens_total") > 0 and metric(text, "hetmoe_generation_tokens_total") > 0
    assert metric(text, "hetmoe_time_to_first_token_seconds_count") > 0
    assert metric(text, "hetmoe_inter_token_latency_seconds_count") > 0
    assert metric(text, "hetmoe_cpu_expert_seconds_total") > 0 and metric(text, "hetmoe_moe_tokens_total") > 0
    for family in ("requests_total", "queue_depth", "running_requests", "time_to_first_token_seconds"):
        assert f"# TYPE hetmoe_{family} " in text
    json.dumps(text)  # plain text, no bytes


# --- the command ------------------------------------------------------------------------------------


def test_hetmoe_serve_command_runs_with_the_key_from_the_environment(model_dir) -> None:
    env = {**os.environ, "HETMOE_API_KEY": "env-key"}
    args = [str(model_dir), "--threads", "1", "--torch-threads", "1", "--model-name", "cli-model"]
    with serve_process([*args, "--log-level", "warning"], env=env) as srv:
        assert httpx.get(srv.url + "/v1/models", timeout=10).status_code == 401
        cli = openai.OpenAI(base_url=srv.url + "/v1", api_key="env-key", max_retries=0)
        r = cli.completions.create(model="cli-model", prompt="Hello", max_tokens=3, temperature=0)
        assert r.usage.completion_tokens <= 3 and r.model == "cli-model"
    assert srv.returncode == 0, srv.stderr
    assert "serving 'cli-model' on http://127.0.0.1:" in srv.stderr and "API key required" in srv.stderr


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-batch", "0"], "--max-batch must be >= 1"),
        (["--max-queue", "-1"], "--max-queue must be >= 0"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--max-model-len", "100000"], "more than the model's max_position_embeddings"),
        (["--api-key", ""], "--api-key is empty"),
    ],
)
def test_serve_bad_arguments_are_one_clear_line(model_dir, extra: list[str], message: str, capsys) -> None:
    from hetmoe.cli.main import main

    assert main(["serve", str(model_dir), "--threads", "1", *extra]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert main(["serve", str(model_dir / "missing")]) == 1
    assert "not a model directory" in capsys.readouterr().err
