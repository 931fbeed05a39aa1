"""`chatapp generate --server URL`: the reply streamed from a running `chatapp serve` (or any OpenAI-compatible
server) instead of a model loaded here. Only the standard library's HTTP client and rich are imported, so the
command answers as soon as the server does: no torch, no model load.

On a terminal it asks for chatapp's extension field and prints forced tokens italic cyan and special tokens dim,
as the local command does (`render.py`); into a pipe it writes the reply's text exactly.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, TextIO

from rich.console import Console
from rich.text import Text

from chatapp.serve.client import stream_chat
from chatapp.settings import GenerationSettings

FORCED_STYLE = "italic cyan"  # as render.py's, which imports torch through the engine
SPECIAL_STYLE = "dim"


def generate_remote(
    server: str,
    prompt: str,
    settings: GenerationSettings,
    console: Console,
    *,
    sampling: Mapping[str, object] | None = None,
    model: str | None = None,
    json_schema: Any = None,
    api_key: str | None = None,
    exact: TextIO | None = None,
    verbose: bool = False,
) -> str | None:
    """Stream the reply to `prompt` from `server`; returns its finish reason. `sampling`: the sampling options the
    user set, sent by their names (the server's fields are the settings' own); the others are the server model's
    defaults."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": settings.max_tokens,
        "seed": settings.seed,
    }
    body.update({name: list(v) if isinstance(v, tuple) else v for name, v in (sampling or {}).items()})
    if model is not None:
        body["model"] = model
    if json_schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "reply", "schema": json_schema}}
    if exact is None:
        body["chatapp"] = {"tokens": True}
    started = time.perf_counter()
    first: float | None = None
    finish: str | None = None
    tokens = 0
    for chunk in stream_chat(server, body, api_key=api_key):
        for choice in chunk.get("choices", ()):
            text = choice.get("delta", {}).get("content") or ""
            if text and first is None:
                first = time.perf_counter()
            if exact is not None:
                exact.write(text)
                exact.flush()
            else:
                for token in choice.get("chatapp", {}).get("tokens", ()):
                    tokens += 1
                    style = SPECIAL_STYLE if token["special"] else FORCED_STYLE if token["forced"] else ""
                    if token["text"]:
                        console.print(Text(token["text"], style=style), end="", soft_wrap=True)
            finish = choice.get("finish_reason") or finish
    if exact is None:
        console.print()
    if verbose:
        total = time.perf_counter() - started
        lines = [
            f"server:             {server}",
            f"total duration:     {total:.3f}s",
            f"time to first text: {(first or time.perf_counter()) - started:.3f}s",
            f"finish reason:      {finish or '-'}",
        ]
        console.print(Text("\n".join(lines), style="dim"))
    return finish
