"""`chatapp generate --server URL`: the reply streamed from a running server, written exactly into a pipe, without
importing torch; and its refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from chatapp.settings import GenerationSettings

ROOT = Path(__file__).resolve().parents[2]


def chatapp(*args: str, importtime: bool = False) -> subprocess.CompletedProcess:
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run(
        [sys.executable, *flags, "-m", "chatapp", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_generate_with_a_server_writes_the_servers_reply_without_torch(served) -> None:
    expected = served.engine.generate_batch(["What is 2+3?"], GenerationSettings(max_tokens=30))[0].text
    done = chatapp("generate", "--server", served.root, "What is 2+3?", "--max-tokens", "30", importtime=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time")]
    assert "torch" not in imported and "chatapp.engine.engine" not in imported


def test_generate_with_an_unreachable_server_says_so() -> None:
    done = chatapp("generate", "--server", "http://127.0.0.1:9", "Hi")
    assert done.returncode == 1
    assert "cannot reach the server" in done.stderr and "fix:" in done.stderr and "Traceback" not in done.stderr


def test_generate_with_a_server_refuses_local_only_options(served) -> None:
    done = chatapp("generate", "--server", served.root, "Hi", "--program", "chat", "--dtype", "int8")
    assert done.returncode == 1
    assert "--dtype, --program cannot be used with --server" in done.stderr


def test_generate_with_a_server_reports_its_refusal(served) -> None:
    done = chatapp("generate", "--server", served.url, "Hi", "--model", "other")
    assert done.returncode == 1
    assert "'other' does not exist here" in done.stderr and "Traceback" not in done.stderr


def test_run_with_a_server_refuses_local_only_options(served) -> None:
    done = chatapp("run", "--server", served.root, "--program", "think")
    assert done.returncode == 1
    assert "--program cannot be used with --server" in done.stderr


def test_run_with_an_unreachable_server_says_so_before_the_tui() -> None:
    done = chatapp("run", "--server", "http://127.0.0.1:9")
    assert done.returncode == 1 and "cannot reach the server" in done.stderr and "Traceback" not in done.stderr
