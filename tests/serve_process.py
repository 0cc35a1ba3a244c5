"""``hetmoe serve`` as a real child process on a free loopback port, for the tests that need the command."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx


@dataclass
class ServeProcess:
    url: str
    stderr: str = ""  # filled in when the process has stopped
    returncode: int | None = None


@contextmanager
def serve_process(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 120, launcher: list[str] | None = None
) -> Iterator[ServeProcess]:
    """Run ``hetmoe serve ARGS --port P`` until /health answers; stop it with SIGINT (Ctrl-C) on exit.
    ``launcher``: what runs ``hetmoe`` (default this Python; e.g. torchrun's ``... -m`` for several ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [*(launcher or [sys.executable, "-m"]), "hetmoe", "serve", *args, "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env or dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    running = ServeProcess(f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                if httpx.get(running.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "hetmoe serve did not start"
            time.sleep(0.2)
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        _, running.stderr = proc.communicate(timeout=30)
        running.returncode = proc.returncode
