"""Each command imports only what it needs: start-up is most of a short command's time (importing torch costs
~1.4 s and 220 MB, transformers' Qwen2 modeling code another 2.4 s and 110 MB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Runs the CLI in a fresh interpreter and prints which of the heavy packages it imported. `chatapp run` stops where
# the TUI would start (its engine process, which loads torch, is started and stopped).
# `main` ends the process itself (`chatapp.lifecycle`), after the atexit handlers: the report is one of them.
PROBE = """
import atexit, json, sys
from chatapp.cli import main
if sys.argv[1:2] == ["run"]:
    from chatapp.ui.app import ChatApp
    ChatApp.run = lambda self: None
sys.argv = ["chatapp", *sys.argv[1:]]
heavy = ("torch", "transformers", "textual", "chatapp.recipes", "chatapp.training")
atexit.register(lambda: print(json.dumps({name: name in sys.modules for name in heavy}), file=sys.stderr))
main()
"""


def imported(*args: str) -> dict[str, bool]:
    env = {**os.environ, "CHATAPP_DEFAULT_MODEL": "tiny"}
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=300)
    return json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [("--help",), ("models",), ("calc", "2+3"), ("generate", "--help")])
def test_commands_that_run_no_model_import_no_torch(args: tuple[str, ...]):
    modules = imported(*args)
    assert not modules["torch"], f"chatapp {' '.join(args)} imported torch"
    assert not modules["transformers"]


def test_generate_runs_the_model_without_transformers_or_the_build_code():
    modules = imported("generate", "hello", "--max-tokens", "2", "--model", "tiny")
    assert modules["torch"]
    assert not modules["transformers"], "the runtime imported transformers"
    assert not modules["chatapp.recipes"], "the runtime imported the build-time recipes"
    assert not modules["chatapp.training"], "the runtime imported the build-time fitting code"
    assert not modules["textual"]


def test_the_tui_process_imports_no_torch(tmp_path):
    """`chatapp run` draws at once: the model (torch and all) loads in its engine process, not in the TUI's, which
    only reads and checks what the user typed (here a program too) and opens the history."""
    modules = imported("run", "--db", str(tmp_path / "h.sqlite3"), "--program", "think")
    assert not modules["torch"], "the TUI's own process imported torch"
    assert not modules["transformers"] and not modules["chatapp.recipes"]
    assert modules["textual"]


def test_importing_the_cli_loads_no_build_code():
    """The runtime stays apart from the build: the CLI module itself imports neither the recipes nor the trainers
    (the commands that need them load them when they run)."""
    probe = (
        "import json, sys, chatapp.cli; print(json.dumps(sorted(m for m in sys.modules if m.startswith('chatapp'))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    loaded = json.loads(done.stdout)
    assert not [m for m in loaded if m.startswith(("chatapp.training", "chatapp.recipes"))], loaded


def test_the_scripts_module_imports_no_cli_until_it_runs():
    """The `chatapp` script imports `chatapp.__main__`; the TUI's engine process imports it again (multiprocessing
    rebuilds `__main__`) and must not load Typer and Rich before the model."""
    probe = "import sys, chatapp.__main__; print(sorted(m for m in ('typer', 'rich', 'click', 'chatapp.cli') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
