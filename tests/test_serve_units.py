"""The serving pieces that need no server: sampling, incremental detokenization and stop strings,
request validation, the Prometheus text format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")

from tiny_models import tiny_chat_model

from hetmoe.serve.metrics import Metrics
from hetmoe.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_supported,
    parse_json,
    validate,
)
from hetmoe.serve.sampling import (
    NGramBan,
    SamplingParams,
    SeenTokens,
    filter_logits,
    make_generator,
    penalize_repetition,
    sample_token,
)
from hetmoe.serve.stops import IncrementalDetokenizer, OutputText, StopMatcher


@pytest.fixture(scope="module")
def tokenizer(tiny_cache):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_chat_model(tiny_cache)))


# --- sampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p"),
    [
        (0.7, 0, 1.0, 0.0),
        (1.3, 5, 1.0, 0.0),
        (0.9, 0, 0.8, 0.0),
        (0.5, 20, 0.6, 0.0),
        (0.7, 40, 0.95, 0.05),
        (1.0, 0, 1.0, 0.1),
        (1.5, 0, 0.9, 0.02),
    ],
)
def test_filtered_distribution_matches_transformers_warpers(
    temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(200, generator=torch.Generator().manual_seed(1)) * 3
    ref = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    if min_p:
        ref = MinPLogitsWarper(min_p)(None, ref)
    ours = filter_logits(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref[0]))
    torch.testing.assert_close(ours.softmax(-1), ref[0].softmax(-1))
    kept = int((~torch.isinf(ours)).sum())
    assert kept < 200 if (top_k or top_p < 1 or min_p) else kept == 200


@pytest.mark.parametrize("penalty", [1.1, 1.5, 0.8])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(100, generator=torch.Generator().manual_seed(3)) * 2
    history = [5, 17, 5, 99, 0, 42, 17]  # repeats count once, as in transformers
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([history]), logits[None].clone())[0]
    ours = penalize_repetition(logits, history, penalty)
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    assert not torch.equal(ours, logits) and torch.equal(penalize_repetition(logits, history, 1.0), logits)
    assert torch.equal(penalize_repetition(logits, [], penalty), logits)
    # The scheduler's running set, built from the prompt and grown a token at a time, gives the same;
    # ids outside the logits row (a tokenizer's added tokens) are ignored.
    seen = SeenTokens([*history[:3], 100, 5000])
    assert torch.equal(penalize_repetition(logits, seen, penalty), penalize_repetition(logits, history[:3], penalty))
    for token in history[3:]:
        seen.add(token)
    assert torch.equal(penalize_repetition(logits, seen, penalty), ref)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ngram_ban_matches_transformers(n: int) -> None:
    """Each step's banned tokens are those NoRepeatNGramLogitsProcessor sets to -inf, over a text
    with repeats, grown a token at a time from a prompt as the scheduler grows it."""
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor

    text = [5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5, 6]
    ban = NGramBan(n, text[:3])
    for length in range(3, len(text) + 1):
        ref = NoRepeatNGramLogitsProcessor(n)(torch.tensor([text[:length]]), torch.zeros(1, 12))[0]
        assert ban.banned() == torch.isinf(ref).nonzero().flatten().tolist(), (n, length)
        if length < len(text):
            ban.add(text[length])
    assert NGramBan(3, [5, 6, 7, 5, 6]).banned() == [7]  # "5 6 7" again is what a 3-gram ban stops
    logits = torch.zeros(12)
    logits[7] = 5.0
    greedy = SamplingParams(1, temperature=0.0)
    assert sample_token(logits, greedy, make_generator(0), ngrams=NGramBan(3, [5, 6, 7, 5, 6])) != 7
    assert sample_token(logits, greedy, make_generator(0)) == 7
    with pytest.raises(ValueError, match="no_repeat_ngram_size must be >= 1"):
        NGramBan(0)


def test_repetition_penalty_steers_greedy_and_sampled_tokens() -> None:
    logits = torch.zeros(10)
    logits[3], logits[4] = 2.0, 1.9  # 3 leads; once seen, 2.0 / 1.1 = 1.82 falls behind 4's 1.9
    greedy = SamplingParams(1, temperature=0.0, repetition_penalty=1.1)
    assert sample_token(logits, greedy, make_generator(0)) == 3
    assert sample_token(logits, greedy, make_generator(0), seen=[3, 3]) == 4
    assert sample_token(logits, SamplingParams(1, temperature=0.0), make_generator(0), seen=[3]) == 3
    # min-p 0.5 keeps only the tokens at least half as likely as the top one: 3 and 4 here.
    hot = SamplingParams(1, temperature=1.0, min_p=0.5, repetition_penalty=1.0)
    assert {sample_token(logits, hot, make_generator(s)) for s in range(40)} == {3, 4}


def test_sampling_is_greedy_at_zero_and_reproducible_with_a_seed() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(2))
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    assert sample_token(logits, greedy, make_generator(None)) == int(logits.argmax())
    hot = SamplingParams(max_tokens=1, temperature=1.5, seed=7)
    draws = [sample_token(logits, hot, g) for g in [make_generator(7)] for _ in range(20)]
    again = [sample_token(logits, hot, g) for g in [make_generator(7)] for _ in range(20)]
    assert draws == again and len(set(draws)) > 1
    # top_k=1 is greedy whatever the temperature; top-p leaves only the top token when it holds the mass.
    assert sample_token(logits, SamplingParams(1, temperature=2.0, top_k=1), make_generator(0)) == int(logits.argmax())
    peaked = torch.full((50,), -20.0)
    peaked[13] = 20.0
    assert all(sample_token(peaked, SamplingParams(1, 1.0, top_p=0.5), make_generator(s)) == 13 for s in range(5))


@pytest.mark.parametrize("temperature", [5e-324, 1.401298464324817e-45, 1e-30, 1e-8])
def test_a_tiny_temperature_samples_the_top_token(temperature: float) -> None:
    """Any temperature above 0 is valid: 5e-324 is 0 in fp32 (0 / 0 is NaN), and logits / 1e-45
    overflow fp32 to inf, whose softmax is NaN (schemathesis found both as 500s). The limit of the
    distribution is the argmax."""
    logits = torch.randn(50, generator=torch.Generator().manual_seed(3)) * 4
    params = SamplingParams(max_tokens=1, temperature=temperature)
    assert all(sample_token(logits, params, make_generator(s)) == int(logits.argmax()) for s in range(5))
    assert torch.isfinite(filter_logits(logits, temperature, 0, 0.9).max())


def test_sampling_frequencies_follow_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    g = make_generator(0)
    params = SamplingParams(max_tokens=1, temperature=1.0)
    counts = torch.bincount(torch.tensor([sample_token(logits, params, g) for _ in range(4000)]), minlength=4)
    torch.testing.assert_close(counts.float() / 4000, logits.softmax(-1), atol=0.03, rtol=0)


# --- stops and detokenization ----------------------------------------------------------------------


def _feed(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(matcher.flush())
    return out, False


def test_stop_strings_across_pieces_never_leak_a_partial_stop() -> None:
    out, stopped = _feed(StopMatcher(["END"]), ["abc E", "N", "D tail"])
    assert stopped and "".join(out) == "abc " and out == ["abc ", "", ""]
    # a held prefix that turns out not to be a stop is released
    out, stopped = _feed(StopMatcher(["END"]), ["x E", "NX", "y"])
    assert not stopped and "".join(out) == "x ENXy" and out[0] == "x "
    # the earliest of several stops wins, even when a longer one started first
    out, stopped = _feed(StopMatcher(["abcd", "bc"]), ["a", "b", "c", "d"])
    assert stopped and "".join(out) == "a"
    out, stopped = _feed(StopMatcher(["\n\n"]), ["line\n", "\nnext"])
    assert stopped and "".join(out) == "line"
    with pytest.raises(ValueError, match="empty"):
        StopMatcher([""])


def test_incremental_detokenization_equals_a_full_decode_and_never_splits_utf8(tokenizer) -> None:
    text = "Café 東京 🙂 naïve — π ≈ 3.14 über the lazy dog"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.split())  # several tokens per multi-byte character
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # a character split over tokens never shows half
    # random ids (broken UTF-8 included): the pieces still add up to what decode() gives for all of them
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rand = torch.randint(0, len(tokenizer), (30,), generator=gen).tolist()
        detok = IncrementalDetokenizer(tokenizer, prompt_ids=ids)
        pieces = [detok.push(t) for t in rand]
        assert not any(p.endswith("\ufffd") for p in pieces)
        full = tokenizer.decode(rand, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert "".join(pieces) + detok.flush() == full


def test_output_text_stops_on_a_string_spanning_tokens(tokenizer) -> None:
    ids = tokenizer("Hello, how are you today? I am fine", add_special_tokens=False)["input_ids"]
    stop = "are yo"
    pieces = [tokenizer.decode([t]) for t in ids]
    assert not any(stop in p for p in pieces)  # no single token holds it
    out = OutputText(tokenizer, [stop])
    emitted = []
    for t in ids:
        text, stopped = out.push(t)
        emitted.append(text)
        if stopped:
            break
    assert stopped and "".join(emitted) == "Hello, how "
    assert all(not e.endswith(("a", "ar", "are", "are ", "are y")) for e in emitted)


# --- request validation -----------------------------------------------------------------------------


def _chat(**fields):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 11.0}, "repetition_penalty"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"no_repeat_ngram_size": 1.5}, "no_repeat_ngram_size"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"seed": 2**64}, "seed"),
    ],
)
def test_invalid_chat_fields_name_the_field(fields: dict, param: str) -> None:
    with pytest.raises(ApiError) as err:
        validate(ChatCompletionRequest, _chat(**fields))
    assert err.value.status == 400 and err.value.param is not None and err.value.param.startswith(param)
    assert err.value.message.startswith(param) and "found" in err.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty")],
)
def test_unsupported_parameters_are_refused(fields: dict, param: str) -> None:
    req = validate(ChatCompletionRequest, _chat(**fields))
    with pytest.raises(ApiError) as err:
        check_supported(req)
    assert err.value.status == 400 and err.value.param == param


def test_completion_prompts_and_json_parsing() -> None:
    assert validate(CompletionRequest, {"model": "m", "prompt": ["x"]}).prompt_value() == "x"
    assert validate(CompletionRequest, {"model": "m", "prompt": [1, 2]}).prompt_value() == [1, 2]
    assert validate(CompletionRequest, {"model": "m", "prompt": [[3]]}).prompt_value() == [3]
    for bad in ({"model": "m", "prompt": ["a", "b"]}, {"model": "m", "prompt": []}, {"model": "m", "prompt": [-1]}):
        with pytest.raises(ApiError):
            validate(CompletionRequest, bad)
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for body in (b"", b"{", b"[1]", b'{"t": NaN}', b"[" * 100000, b"\xff\xfe"):
        with pytest.raises(ApiError) as err:
            parse_json(body)
        assert err.value.status == 400 and err.value.code == "invalid_json"


# --- metrics ---------------------------------------------------------------------------------------


def test_metrics_render_prometheus_text() -> None:
    m = Metrics()
    m.requests.inc(endpoint="/v1/completions", status="200")
    m.requests.inc(endpoint="/v1/completions", status="200")
    m.ttft.observe(0.003)
    m.ttft.observe(100.0)
    m.add_gauge("queue_depth", "waiting", lambda: 3)
    text = m.render()
    assert 'hetmoe_requests_total{endpoint="/v1/completions",status="200"} 2' in text
    assert 'hetmoe_time_to_first_token_seconds_bucket{le="0.0025"} 0' in text
    assert 'hetmoe_time_to_first_token_seconds_bucket{le="0.005"} 1' in text
    assert 'hetmoe_time_to_first_token_seconds_bucket{le="60"} 1' in text
    assert 'hetmoe_time_to_first_token_seconds_bucket{le="+Inf"} 2' in text
    assert "hetmoe_time_to_first_token_seconds_count 2" in text and "hetmoe_queue_depth 3" in text
    for line in text.splitlines():  # every sample line is NAME[{labels}] VALUE
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            float(value.replace("+Inf", "inf"))
            assert name.startswith("hetmoe_")
    assert "# TYPE hetmoe_time_to_first_token_seconds histogram" in text


def test_tiny_chat_model_has_a_chat_template(tiny_cache) -> None:
    path: Path = tiny_chat_model(tiny_cache)
    config = json.loads((path / "config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == config["vocab_size"] and tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_no_event_reaches_a_request_after_its_failure() -> None:
    """stop() fails the requests a worker still holds when its join times out, while that worker may
    still be mid-step and emit their Deltas: once a Finished or Failed went out, nothing follows it,
    whichever thread sends it (a worker thread emitting Deltas races the failure here)."""
    import threading

    from hetmoe.serve.scheduler import Delta, Failed, Scheduler, Sequence

    scheduler = Scheduler(torch.nn.Linear(2, 2), None, frozenset())
    for _ in range(5):
        got: list = []
        seq = Sequence([1], SamplingParams(max_tokens=4), got.append)
        started, failed_sent = threading.Event(), threading.Event()

        def worker(seq=seq, started=started, failed_sent=failed_sent) -> None:
            started.set()
            while not failed_sent.is_set():
                scheduler._emit(seq, Delta("x"))
            for _ in range(100):  # the steps a worker still finishes after the failure
                scheduler._emit(seq, Delta("late"))

        t = threading.Thread(target=worker)
        t.start()
        started.wait()
        scheduler._emit(seq, Failed("the server is shutting down"))
        failed_sent.set()
        t.join()
        failed = [i for i, e in enumerate(got) if isinstance(e, Failed)]
        assert failed == [len(got) - 1], (failed, len(got))


def test_sampling_defaults_come_from_generation_config(tmp_path: Path) -> None:
    from hetmoe.checkpoint import CheckpointError
    from hetmoe.serve.app import _sampling
    from hetmoe.serve.protocol import CompletionRequest
    from hetmoe.serve.served_model import SamplingDefaults, ServedModel, _sampling_defaults

    assert _sampling_defaults(tmp_path) == SamplingDefaults()  # OpenAI's when there is no file
    config = {"temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.1}
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "no_repeat_ngram_size": 4}))
    d = _sampling_defaults(tmp_path)
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.repetition_penalty) == (0.7, 40, 0.95, 0.05, 1.1)
    assert d.no_repeat_ngram_size == 4
    # A request that leaves a field out gets the model's value, one that sets it its own.
    served = ServedModel("m", None, None, None, 64, frozenset(), 100, defaults=d)
    params = _sampling(served, CompletionRequest(model="m", prompt="x"), [1, 2], None, None)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty) == (
        0.7,
        40,
        0.95,
        0.05,
        1.1,
    )
    req = CompletionRequest(model="m", prompt="x", temperature=0.0, min_p=0.0, repetition_penalty=1.0)
    params = _sampling(served, req, [1, 2], None, None)
    assert (params.temperature, params.min_p, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert _sampling(served, CompletionRequest(model="m", prompt="x"), [1], None, None).no_repeat_ngram_size == 4
    req = CompletionRequest(model="m", prompt="x", no_repeat_ngram_size=0)
    assert _sampling(served, req, [1], None, None).no_repeat_ngram_size == 0
    # Values no sampler takes are the loader's one-line error naming the file, not silently dropped.
    for bad in (
        {"min_p": 3},
        {"repetition_penalty": 0},
        {"top_p": 0.0},
        {"temperature": -1},
        {"no_repeat_ngram_size": -1},
    ):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=rf"generation_config.json.*{next(iter(bad))} must be"):
            _sampling_defaults(tmp_path)


_MMAP_PROBE = """
import ctypes
from hetmoe.models.loader import pin_mmap_threshold
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes, libc.mallinfo2.restype = ctypes.c_void_p, [ctypes.c_void_p], Info
print(pin_mmap_threshold())
libc.free(libc.malloc(8 << 20))  # a freed mapped block: glibc's own rule raises the threshold past it
before = libc.mallinfo2().hblkhd
block = libc.malloc(8 << 20)
print(libc.mallinfo2().hblkhd - before >= 8 << 20)  # mapped again, not carved from the heap
libc.free(block)
"""


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL("libc.so.6"), "mallinfo2"), reason="glibc >= 2.33 only")
@pytest.mark.parametrize(("env", "want"), [(None, "0\nFalse"), ("0", "0\nFalse"), ("131072", "131072\nTrue")])
def test_serving_pins_the_mmap_threshold(env: str | None, want: str) -> None:
    """With HETMOE_MMAP_THRESHOLD set, pin_mmap_threshold (called by hetmoe serve) keeps large blocks
    in mappings of their own after a bigger one was freed, where glibc's dynamic rule (unset or 0,
    the default) serves them from the heap."""
    import os
    import subprocess
    import sys

    environ = {k: v for k, v in os.environ.items() if k != "HETMOE_MMAP_THRESHOLD"}
    if env is not None:
        environ["HETMOE_MMAP_THRESHOLD"] = env
    out = subprocess.run([sys.executable, "-c", _MMAP_PROBE], capture_output=True, text=True, env=environ, check=True)
    assert out.stdout.strip() == want


def test_a_bad_mmap_threshold_is_named(monkeypatch) -> None:
    from hetmoe.models.loader import pin_mmap_threshold

    monkeypatch.setenv("HETMOE_MMAP_THRESHOLD", "lots")
    with pytest.raises(ValueError, match=r"HETMOE_MMAP_THRESHOLD='lots': expected a number of bytes"):
        pin_mmap_threshold()
