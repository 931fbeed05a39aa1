"""What `chatapp generate` reads besides its arguments: a prompt from stdin (`generate -`) and a `--json-schema`
given inline or as a file. Each failure is the user's to fix: a `ChatappError` naming the input."""

from __future__ import annotations

import json
import os
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
    inline = value.lstrip().startswith(("{", "[")) or value.strip() in ("true", "false")
    is_file = not inline and _is_file(path)
    if not inline and not is_file and (path.suffix.lower() == ".json" or os.sep in value):
        # Not JSON and not a file: a path that is not there (a typo, the wrong directory) is far likelier than
        # a schema someone meant inline, and "not valid JSON" would send them looking at the wrong thing.
        problem = "is a directory" if _is_dir(path) else "is not a file" if os.path.lexists(path) else "does not exist"
        raise ConstraintError(
            f"the --json-schema file {path} {problem}",
            hint="pass the path of a JSON Schema file, or the schema itself inline ('{\"type\": ...}')",
        )
    if is_file:
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
        if text is not value:
            problem = f"the --json-schema file {path} is not valid JSON: {err}"
        elif inline:
            problem = f"--json-schema is not valid JSON: {err}"
        else:
            problem = f"--json-schema {value[:40]!r} is neither a file nor valid JSON ({err})"
        raise ConstraintError(
            problem, hint="pass the schema inline ('{\"type\": ...}') or a .json file"
        ) from None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # a name too long to be a path (a long inline value)
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False
