"""With the default model, a served greedy reply is `chatapp generate`'s text byte for byte, the calculator's call
and result included, while other requests share its batch (each prompt is prefilled alone, and the CPU's native
decode step computes a row the same whatever rows are beside it)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .conftest import running_server

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["What is 37*45?", "Hi", "Name three colours.", "How many r are in strawberry?"]


@pytest.mark.slow
def test_served_greedy_replies_are_generates(default_model_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from chatapp.models import load_engine

    monkeypatch.setenv("CHATAPP_HOME", str(default_model_home))
    monkeypatch.setenv("CHATAPP_DEFAULT_MODEL", "default")
    engine = load_engine("default", "cpu")
    generated = [
        subprocess.run(
            [sys.executable, "-m", "chatapp", "generate", prompt, "--max-tokens", "48"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ),
            check=True,
        ).stdout
        for prompt in PROMPTS
    ]
    assert "1665" in generated[0], "the default model calls the calculator for 37*45"
    with running_server(engine, model_id="default") as server:
        client = server.client()

        def ask(prompt: str) -> str:
            reply = client.chat.completions.create(
                model="default", messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0
            )
            return reply.choices[0].message.content

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together: they share the batch
            served = list(pool.map(ask, PROMPTS))
    assert served == generated
