"""Errors a user can cause. Each names the input at fault and the fix; the CLI prints them without a traceback.

`user_message` is the one place an error becomes what the user reads: the CLI's `error:` and `fix:` lines, a batch
record's `error` text and the TUI's notices all come from it, so none of them can show an error without its fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class ChatappError(Exception):
    """Base class for user-caused errors. `str(err)` is the whole message shown to the user, its fix included.

    `hint` is the fix. Every raise site passes one (tests/hostile/test_issue41_messages.py checks); a subclass's
    `default_hint` stands in only where a hint is forwarded from another error that had none.
    """

    exit_code: int = 1
    default_hint: str = "see `chatapp --help` and `chatapp COMMAND --help`"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message)

    def __str__(self) -> str:
        return user_message(self).text()

    def __reduce__(self):
        # Errors cross a process boundary (the TUI's engine process): keep the subclass and every field, which
        # the default (`cls(*args)`) would not for subclasses with keyword-only fields.
        return (_restore_error, (type(self), self.args, self.__dict__))


def _restore_error(cls: type[ChatappError], args: tuple, state: dict) -> ChatappError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


@dataclass(frozen=True)
class UserMessage:
    """What a user reads about an error they caused: the error and its fix, each one line."""

    error: str
    fix: str

    def one_line(self) -> str:
        """Both on one line, for a JSONL record or a status line."""
        return f"{self.error}; fix: {self.fix}"

    def text(self) -> str:
        """Both as two lines, for a notice (and `str()` of the error)."""
        return f"{self.error}\n  fix: {self.fix}"


def user_message(err: ChatappError) -> UserMessage:
    """The error and its fix for `err` (its class's default fix when it was raised without one); a line break inside
    either (a library's message, a quoted input) becomes a space, so each stays one line wherever it is shown."""
    return UserMessage(_one_line(err.message), _one_line(err.hint or type(err).default_hint))


def _one_line(text: str) -> str:
    return re.sub(r"\s*[\r\n]+\s*", " ", text.strip())


class ModelDirError(ChatappError):
    """A model directory is missing, incomplete or unreadable."""

    default_hint = "pass --model with a name `chatapp models` lists, or a complete model directory"


class ProgramError(ChatappError):
    """A TTFA program (TOML file, builder or name) does not compile.

    `file`, `line` (1-based) and `zone` locate the fault, each None when unknown; the message starts with them,
    compiler style: `think.toml:12: zone 'think': ...`.
    """

    default_hint = "`chatapp program check FILE` shows the first error; or use chat, think, calc or json"

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        file: str | None = None,
        line: int | None = None,
        zone: str | None = None,
    ) -> None:
        self.file, self.line, self.zone = file, line, zone
        place = ":".join(str(part) for part in (file, line) if part is not None)
        where = ": ".join(part for part in (place, f"zone {zone!r}" if zone else "") if part)
        super().__init__(f"{where}: {message}" if where else message, hint=hint)


class ConstraintError(ChatappError):
    """A regex or JSON schema constraint cannot be compiled."""

    default_hint = "use a simpler regex or JSON schema"


class InputLineError(ChatappError):
    """A JSONL input line is malformed."""

    default_hint = "fix that line of the input file"


class BatchFileError(ChatappError):
    """A batch input or output file cannot be read or written, or an output cannot be resumed (it exists without
    --resume, or is not a batch output)."""

    default_hint = "check the path and its permissions"


class ToolError(ChatappError):
    """A tool expression was refused (used by the CLI's `calc`)."""

    default_hint = 'use numbers, + - * / // %, parentheses and "text".count("x")'


class ConversationError(ChatappError):
    """A conversation (list of message dicts) is malformed: unknown role, wrong order, bad content parts."""

    default_hint = 'give messages as {"role": "system" | "user" | "assistant", "content": "text"}'


class ContextOverflowError(ChatappError):
    """A conversation no longer fits the model's context under the 'error' policy."""

    default_hint = "start a new conversation or shorten the prompt"


class SettingsError(ChatappError):
    """A setting has an invalid value."""


class TrainingError(ChatappError):
    """Training cannot start or resume: corpus too small for the window, unusable checkpoint or init config."""

    default_hint = "see `chatapp train --help`"


class HistoryError(ChatappError):
    """The chat history database cannot be used: a directory, another program's database, unreadable."""

    default_hint = "pass --db with a writable file path, or fix the permissions"


class DataDirError(ChatappError):
    """The data directory (or an output directory the app writes like it) cannot be used: a file in its place, not
    writable, or a stored file that is not a regular file."""

    default_hint = "set CHATAPP_HOME to a writable directory"


class ServerError(ChatappError):
    """A `chatapp serve` server (`--server URL`) could not be reached, or refused the request."""

    default_hint = "check the URL and that `chatapp serve` runs there"
