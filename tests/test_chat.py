"""``hetmoe chat`` fed from stdin against a real server: turns, history, /save, /reset, /exit, Ctrl-C."""

from __future__ import annotations

import io
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")

import httpx
import openai
from tiny_models import tiny_chat_model

from hetmoe import load_model
from hetmoe.cli.chat import Chat, base_url, stream_reply
from hetmoe.cli.main import main
from hetmoe.serve.app import build_app
from hetmoe.serve.background import BackgroundServer
from hetmoe.serve.served_model import load_served_model

KEY = "chat-test-key"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_cache) -> Path:
    return tiny_chat_model(tiny_cache)


@pytest.fixture(scope="module")
def server(model_dir):
    served = load_served_model(model_dir, name="tiny-chat", threads=1)
    with BackgroundServer(build_app(served, api_key=KEY, max_batch=4, max_queue=4)) as srv:
        yield srv


@pytest.fixture(scope="module")
def greedy(model_dir):
    """The greedy reply to a conversation, by transformers' generate on a separately loaded model."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model(model_dir, cpu_threads=1)
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def reply(messages: list[dict[str, str]], max_tokens: int) -> str:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0
            )
        return tok.decode(out[0, len(ids) :], skip_special_tokens=True, clean_up_tokenization_spaces=False)

    return reply


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def test_a_session_from_stdin_keeps_history_saves_and_resets(server, greedy, tmp_path, monkeypatch, capsys) -> None:
    first, second = tmp_path / "after-two-turns.json", tmp_path / "sub" / "after-reset.json"
    lines = ["Hello there", "", "What now?", f"/save {first}", "/reset", f"/save {second}", "/bogus", "/exit"]
    lines.append("this line is never sent")
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(lines) + "\n"))
    argv = ["chat", "--url", server.url, "--api-key", KEY, "--system", "Be brief.", "--temperature", "0"]
    assert main([*argv, "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out

    saved = json.loads(first.read_text())
    assert saved["model"] == "tiny-chat"
    roles = [m["role"] for m in saved["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    msgs = saved["messages"]
    assert [m["content"] for m in msgs[:2]] == ["Be brief.", "Hello there"] and msgs[3]["content"] == "What now?"
    # each reply is the greedy answer to the whole conversation before it (the history is sent)
    assert msgs[2]["content"] == greedy(msgs[:2], 12)
    assert msgs[4]["content"] == greedy(msgs[:4], 12)
    assert msgs[2]["content"] in out and msgs[4]["content"] in out

    assert json.loads(second.read_text())["messages"] == [{"role": "system", "content": "Be brief."}]
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".partial")]  # written atomically
    assert "[conversation cleared]" in out and "unknown command /bogus" in out
    assert "saved 5 messages" in out and "saved 1 messages" in out


class _InterruptingOut(io.StringIO):
    """A terminal whose user presses Ctrl-C once ``after`` characters of the reply have been shown."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after = after
        self.fired = False

    def write(self, s: str) -> int:
        n = super().write(s)
        if not self.fired and len(self.getvalue()) >= self.after:
            self.fired = True
            raise KeyboardInterrupt
        return n


def test_ctrl_c_stops_the_reply_closes_the_stream_and_the_chat_goes_on(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    cancelled = _metric(server, "hetmoe_requests_cancelled_total")
    out = _InterruptingOut(after=1)
    # A long reply (ignore_eos): only a disconnect can end it early.
    chat = Chat(stream_reply(client, "tiny-chat", {"max_tokens": 1900, "extra_body": {"ignore_eos": True}}), out)
    assert chat.handle("Tell me a long story")
    assert out.fired and out.getvalue().endswith("\n[stopped]\n")
    partial = chat.messages[-1]
    assert partial["role"] == "assistant" and partial["content"] and out.getvalue().startswith(partial["content"])
    deadline = time.monotonic() + 10
    while _metric(server, "hetmoe_running_requests") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "hetmoe_running_requests") == 0
    assert _metric(server, "hetmoe_requests_cancelled_total") == cancelled + 1
    # the next turn works and carries the interrupted one in its history
    quiet = Chat(stream_reply(client, "tiny-chat", {"max_tokens": 3}), io.StringIO())
    quiet.messages = list(chat.messages)
    assert quiet.handle("go on") and [m["role"] for m in quiet.messages][-2:] == ["user", "assistant"]


def test_server_errors_are_shown_and_the_turn_is_dropped(server) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = io.StringIO()
    chat = Chat(stream_reply(client, "no-such-model", {}), out)
    assert chat.handle("hi")
    assert chat.messages == [] and "[error: model: 'no-such-model' is not served here" in out.getvalue()


def test_without_url_it_serves_a_local_model_in_process(model_dir, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n"))  # end of input leaves, like Ctrl-D
    assert main(["chat", "--local", str(model_dir), "--threads", "1", "--temperature", "0", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"chatting with \S+ at http://127\.0\.0\.1:\d+/v1", out)
    assert len(out.splitlines()) >= 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--url", "ftp://host"], "expected http(s)://"),
        (["--url", "http://127.0.0.1:9", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--url", "http://127.0.0.1:9", "--temperature", "3"], "--temperature must be in [0, 2]"),
        (["--url", "http://127.0.0.1:9", "--local", "x"], "do not go with --url"),
        (["--url", "http://127.0.0.1:9"], "cannot list models"),
    ],
)
def test_bad_arguments_are_one_clear_line(argv: list[str], message: str, capsys: Any) -> None:
    assert main(["chat", *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_base_url() -> None:
    assert base_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000/v1"
    assert base_url("http://127.0.0.1:8000/") == "http://127.0.0.1:8000/v1"
    assert base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000/v1"
    assert base_url("https://example.com/openai/v1") == "https://example.com/openai/v1"


def test_a_reply_stopped_before_any_text_drops_the_turn() -> None:
    out = io.StringIO()
    chat = Chat(lambda messages, out: ("", True), out, system="S")
    assert chat.handle("hi") and chat.messages == [{"role": "system", "content": "S"}]
    chat = Chat(lambda messages, out: ("par", True), out)
    assert chat.handle("hi") and chat.messages[-1] == {"role": "assistant", "content": "par"}
    assert not chat.handle("/exit") and not chat.handle("/quit")
