"""``hetmoe chat``: a terminal chat against any OpenAI-compatible server, streaming the replies.

Without --url it starts hetmoe's own server in this process, on a free loopback port, with the
embedded default model (or --local MODEL: a directory or a .gguf file). The conversation is kept
and sent whole each turn.
Commands: ``/reset`` forgets the conversation (the system prompt stays), ``/save FILE`` writes it
as JSON (atomically), ``/exit`` leaves (so do Ctrl-D and end of input). Ctrl-C during a reply stops
that reply, closing the stream so the server stops generating, and keeps what arrived.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

from ..checkpoint.atomic import write_text_atomic

Reply = Callable[[list[dict[str, str]], TextIO], tuple[str, bool]]  # (messages, out) -> (text, interrupted)
HELP = "commands: /reset (forget the conversation), /save FILE (write it as JSON), /exit (leave)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat",
        help="chat in the terminal with an OpenAI-compatible server (hetmoe's own by default)",
        description=(
            "An interactive chat that streams replies from any OpenAI-compatible server. Without --url it starts "
            "hetmoe's server in this process on a free 127.0.0.1 port with the embedded default model (or --local "
            "DIR). " + HELP + ". Ctrl-C during a reply stops the reply; Ctrl-D or /exit leaves."
        ),
        epilog=(
            "examples:\n"
            "  hetmoe chat\n"
            '  hetmoe chat --system "You are terse." --temperature 0.7\n'
            "  hetmoe chat --url http://127.0.0.1:8000/v1 --api-key secret\n"
            "  hetmoe chat --local /models/Qwen3-30B-A3B --method int4"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000/v1 (default: start one here)")
    p.add_argument("--model", help="model id to ask for (default: the first the server lists)")
    p.add_argument("--system", help="a system prompt that opens the conversation")
    p.add_argument("--api-key", help="bearer key for the server (default: $HETMOE_API_KEY, then $OPENAI_API_KEY)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N", help="reply length limit (default: none)")
    p.add_argument(
        "--local",
        metavar="MODEL",
        help="without --url: serve this model directory or .gguf file instead of the default",
    )
    p.add_argument("--method", choices=("bf16", "int8", "int4"), help="without --url: experts' CPU method")
    p.add_argument("--threads", type=int, default=None, help="without --url: CPU engine threads")
    p.set_defaults(run=run)


def base_url(url: str) -> str:
    """``url`` as an OpenAI base URL: ``/v1`` added when it names only a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--url {url!r}: expected http(s)://HOST[:PORT][/PATH]")
    return url.rstrip("/") + "/v1" if parts.path in ("", "/") else url.rstrip("/")


class Chat:
    """The conversation and the commands; ``reply`` is how a turn reaches the model."""

    def __init__(
        self,
        reply: Reply,
        out: TextIO,
        system: str | None = None,
        model: str = "",
    ) -> None:
        self.reply = reply
        self.out = out
        self.system = system
        self.model = model
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def save(self, target: str) -> Path:
        path = Path(target).expanduser()
        data = {"model": self.model, "messages": self.messages}
        write_text_atomic(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        return path

    def handle(self, line: str) -> bool:
        """One line of input: a command or a message. False when the chat should end."""
        text = line.strip()
        if not text:
            return True
        if text.startswith("/"):
            return self._command(text)
        self.messages.append({"role": "user", "content": text})
        try:
            answer, interrupted = self.reply(self.messages, self.out)
        except Exception as exc:  # the server refused or failed: say so and let the user go on
            self.messages.pop()
            self.out.write(f"\n[error: {_describe_error(exc)}]\n")
            self.out.flush()
            return True
        if interrupted and not answer:
            self.messages.pop()  # stopped before any of the reply arrived: as if never asked
            return True
        # An interrupted reply is kept as far as it came: it is what the user saw.
        self.messages.append({"role": "assistant", "content": answer})
        return True

    def _command(self, text: str) -> bool:
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.reset()
            self.out.write("[conversation cleared]\n")
        elif name == "/save":
            if not arg:
                self.out.write("[usage: /save FILE]\n")
            else:
                try:
                    path = self.save(arg)
                    self.out.write(f"[saved {len(self.messages)} messages to {path}]\n")
                except OSError as exc:
                    self.out.write(f"[cannot save to {arg}: {exc}]\n")
        elif name == "/help":
            self.out.write(HELP + "\n")
        else:
            self.out.write(f"[unknown command {name}; {HELP}]\n")
        self.out.flush()
        return True


def _describe_error(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return f"{type(exc).__name__}: {exc}"


def stream_reply(client: Any, model: str, sampling: dict[str, Any]) -> Reply:
    """A ``reply`` that streams one chat completion to ``out``; Ctrl-C closes the stream and keeps the text so far."""

    def reply(messages: list[dict[str, str]], out: TextIO) -> tuple[str, bool]:
        try:
            stream = client.chat.completions.create(model=model, messages=messages, stream=True, **sampling)
        except KeyboardInterrupt:  # before the reply started: the request is abandoned (its connection closed)
            out.write("\n[stopped]\n")
            out.flush()
            return "", True
        parts: list[str] = []
        interrupted = False
        try:
            for chunk in stream:
                delta = chunk.choices[0].delta.content if chunk.choices else None
                if delta:
                    parts.append(delta)
                    out.write(delta)
                    out.flush()
        except KeyboardInterrupt:
            interrupted = True
        finally:
            stream.close()  # the server sees the disconnect and stops generating
        out.write("\n[stopped]\n" if interrupted else "\n")
        out.flush()
        return "".join(parts), interrupted

    return reply


def repl(chat: Chat, stdin: TextIO, out: TextIO, prompt: str = "> ") -> int:
    """Read lines until /exit or end of input; the prompt (and line editing) only on a terminal."""
    interactive = stdin.isatty() and stdin is sys.stdin
    while True:
        try:
            if interactive:
                line = input(prompt)
            else:
                line = stdin.readline()
                if not line:
                    break
        except EOFError:
            break
        except KeyboardInterrupt:
            out.write("\n[Ctrl-C stops a reply; /exit or Ctrl-D leaves]\n")
            continue
        try:
            if not chat.handle(line):
                break
        except KeyboardInterrupt:  # outside a reply (e.g. while saving): stop that, stay in the chat
            out.write("\n[stopped]\n")
    return 0


def _start_local_server(args: argparse.Namespace) -> tuple[Any, str]:
    from ..serve.app import build_app
    from ..serve.background import BackgroundServer
    from ..serve.served_model import load_served_model
    from .serve import resolve_model

    path, name = resolve_model(args.local)
    print(f"loading {path} ...", file=sys.stderr)
    served = load_served_model(path, name=name, method=args.method, threads=args.threads)
    server = BackgroundServer(build_app(served, max_batch=4, max_queue=4)).start()
    return server, server.url + "/v1"


def run(args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None) -> int:
    import openai

    stdin = stdin or sys.stdin
    out = out or sys.stdout
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.temperature is not None and not 0 <= args.temperature <= 2:
        raise ValueError(f"--temperature must be in [0, 2], got {args.temperature}")
    if args.url is not None and (args.local or args.method):
        raise ValueError("--local and --method choose the model of the server started here; they do not go with --url")
    server = None
    if args.url is None:
        server, url = _start_local_server(args)
        key = "local"  # the in-process server runs without a key
    else:
        url = base_url(args.url)
        key = args.api_key or os.environ.get("HETMOE_API_KEY") or os.environ.get("OPENAI_API_KEY") or "none"
    try:
        client = openai.OpenAI(base_url=url, api_key=key, max_retries=0)
        try:
            model = args.model or client.models.list().data[0].id
        except openai.APIError as exc:
            raise ValueError(f"{url}: cannot list models: {_describe_error(exc)}") from None
        except IndexError:
            raise ValueError(f"{url}: the server lists no models; pass --model") from None
        sampling: dict[str, Any] = {}
        if args.temperature is not None:
            sampling["temperature"] = args.temperature
        if args.max_tokens is not None:
            sampling["max_tokens"] = args.max_tokens
        chat = Chat(stream_reply(client, model, sampling), out, system=args.system, model=model)
        out.write(f"chatting with {model} at {url}; {HELP}\n")
        out.flush()
        return repl(chat, stdin, out)
    finally:
        if server is not None:
            server.stop()
