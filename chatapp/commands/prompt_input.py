"""What `chatapp generate` reads besides its arguments: a prompt from stdin (`generate -`) and a `--json-schema`
given inline or as a file. Each failure is the user's to fix: a `ChatappError` naming the input."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from chatapp.errors import ConstraintError, SettingsError

err_console = Console(stderr=True, highlight=False)


def read_prompt() -> str:
    """`generate -`: the prompt from stdin, for prompts longer than one argument may be (Linux caps one at 128 KiB).
    A final line break is the shell's (`echo`, a file's last line), not the prompt's."""
    from chatapp.validation import MAX_PROMPT_BYTES

    unreadable = "pipe the prompt into `chatapp generate -`, or pass it as an argument"
    if sys.stdin is None:  # started with stdin closed
        raise SettingsError("`generate -` reads the prompt from stdin, which is closed", hint=unreadable)
    if sys.stdin.isatty():
        err_console.print("reading the prompt: end it with ctrl+d on a line of its own", markup=False)
    stream = getattr(sys.stdin, "buffer", None)
    try:
        data = stream.read(MAX_PROMPT_BYTES + 1) if stream else sys.stdin.read(MAX_PROMPT_BYTES + 1).encode()
    except OSError as err:  # stdin is a directory, or a device that fails
        raise SettingsError(f"cannot read the prompt from stdin: {err.strerror or err}", hint=unreadable) from None
    if len(data) > MAX_PROMPT_BYTES:
        raise SettingsError(
            f"the prompt on stdin is more than {MAX_PROMPT_BYTES:,} bytes, more than any model here can read",
            hint="shorten the prompt",
        )
    # Bytes that are not UTF-8 become lone surrogates, which `check_prompt_text` names, as it does for an argument.
    return data.decode("utf-8", errors="surrogateescape").removesuffix("\n").removesuffix("\r")


def read_json_schema(value: str) -> Any:
    """A `--json-schema` value: inline JSON, or the path of a file holding it."""
    text = value
    path = Path(value).expanduser()
    if not value.lstrip().startswith(("{", "[")) and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            problem = "is not UTF-8 text" if isinstance(err, UnicodeDecodeError) else f"cannot be read: {err.strerror}"
            raise ConstraintError(
                f"the --json-schema file {path} {problem}", hint="pass a JSON Schema file (UTF-8 JSON) or inline JSON"
            ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConstraintError(
            f"--json-schema is not valid JSON: {err}", hint="pass the schema inline ('{\"type\": ...}') or a .json file"
        ) from None
