"""Export a saved conversation as Markdown (to read) and JSON (to process, with per-token forced flags and tags)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from chatapp.errors import DataDirError
from chatapp.store import atomic_write
from chatapp.tools.parts import MARKDOWN_WRAP, content_text
from chatapp.ui.history import Conversation, StoredMessage


def to_markdown(conversation: Conversation) -> str:
    summary = conversation.summary
    lines = [f"# {summary.title}", ""]
    lines.append(f"model: {summary.model or '?'} · program: {summary.program or 'none'}")
    for message in conversation.messages:
        lines += ["", f"## {message.role}" + (" (interrupted)" if message.status == "interrupted" else ""), ""]
        lines.append(_markdown_content(message))
    return "\n".join(lines).rstrip() + "\n"


def _markdown_content(message: StoredMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    return content_text(message.content, MARKDOWN_WRAP).strip()


def to_json(conversation: Conversation) -> dict[str, Any]:
    summary = conversation.summary
    return {
        "title": summary.title,
        "model": summary.model,
        "program": summary.program,
        "created": summary.created,
        "messages": [
            {
                "role": m.role,
                "content": m.content,
                "status": m.status,
                "tokens": [
                    {"id": t.token, "text": t.text, "forced": t.forced, "special": t.special, "tags": list(t.tags)}
                    for t in m.tokens
                ],
            }
            for m in conversation.messages
        ],
    }


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")[:40] or "chat"


def export_conversation(conversation: Conversation, directory: Path, *, now: float) -> tuple[Path, Path]:
    """Write `<slug>-<time>.md` and `.json` into `directory`; returns both paths. Never over anything already there
    (an earlier export of the same second, or whatever else is at the name): such a name gets `-2`, `-3`, ... Each
    file is written whole and renamed into place (`store.atomic_write`). A directory that cannot be written
    (read-only, disk full, a file in its place) is a `DataDirError`, and no half-written export is left."""
    stem = f"{_slug(conversation.summary.title)}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime(now))}"
    written: list[Path] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        markdown, data = _free_names(directory, stem)
        for path, text in (
            (markdown, to_markdown(conversation)),
            (data, json.dumps(to_json(conversation), indent=2, ensure_ascii=False) + "\n"),
        ):
            atomic_write(path, lambda tmp, text=text: tmp.write_text(text, encoding="utf-8"), mode=0o644)
            written.append(path)
    except OSError as err:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        raise DataDirError(
            f"cannot export the conversation to {directory}: {err.strerror or err}",
            hint=f"free disk space or make {directory} writable, or set CHATAPP_HOME to a writable directory",
        ) from None
    return markdown, data


def _free_names(directory: Path, stem: str) -> tuple[Path, Path]:
    """The first `STEM.md` / `STEM.json` pair (then `STEM-2`, ...) of which neither name is taken by anything."""
    number = 1
    while True:
        name = stem if number == 1 else f"{stem}-{number}"
        pair = (directory / f"{name}.md", directory / f"{name}.json")
        if not any(os.path.lexists(path) for path in pair):
            return pair
        number += 1
