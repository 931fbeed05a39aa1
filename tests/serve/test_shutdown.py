"""`chatapp serve` as a process: SIGTERM with a reply in flight ends it with exit 0 within the bound, the reply
finished or cut; Ctrl-C twice exits at once."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "chatapp", "serve", "--model", "tiny", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                if response.status == 200:
                    return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    pytest.fail(f"the server did not start: {process.stderr.read() if process.stderr else ''}")


def stream_in_background(port: int) -> tuple[threading.Thread, list[bytes], threading.Event]:
    """A streamed request whose first event has arrived when this returns."""
    lines: list[bytes] = []
    started = threading.Event()
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 2.0, "stream": True}
    ).encode()

    def run() -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                for line in response:
                    lines.append(line)
                    started.set()
        except OSError:
            pass
        started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(30)
    return thread, lines, started


def test_sigterm_ends_the_server_with_exit_0_within_the_bound() -> None:
    port = free_port()
    process = start_server(port)
    thread, lines, _ = stream_in_background(port)
    signaled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        code = process.wait(timeout=15)
    finally:
        process.kill()
    assert code == 0, process.stderr.read() if process.stderr else ""
    assert time.monotonic() - signaled < 15
    thread.join(5)
    assert b"data: [DONE]\n" in lines or not thread.is_alive()


def test_a_second_ctrl_c_exits_at_once() -> None:
    port = free_port()
    process = start_server(port)
    stream_in_background(port)
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGINT)
    try:
        code = process.wait(timeout=5)
    finally:
        process.kill()
    assert code == 0
