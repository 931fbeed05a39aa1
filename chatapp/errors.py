"""Errors a user can cause. Each names the input at fault and the fix; the CLI prints them without a traceback."""

from __future__ import annotations


class ChatappError(Exception):
    """Base class for user-caused errors. `str(err)` is the whole message shown to the user."""

    exit_code: int = 1

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  fix: {hint}")

    def __reduce__(self):
        # Errors cross a process boundary (the TUI's engine process): keep the subclass and every field, which
        # the default (`cls(*args)`) would not for subclasses with keyword-only fields.
        return (_restore_error, (type(self), self.args, self.__dict__))


def _restore_error(cls: type[ChatappError], args: tuple, state: dict) -> ChatappError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class ModelDirError(ChatappError):
    """A model directory is missing, incomplete or unreadable."""


class ProgramError(ChatappError):
    """A TTFA program (TOML file, builder or name) does not compile.

    `file`, `line` (1-based) and `zone` locate the fault, each None when unknown; the message starts with them,
    compiler style: `think.toml:12: zone 'think': ...`.
    """

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


class InputLineError(ChatappError):
    """A JSONL input line is malformed."""


class BatchFileError(ChatappError):
    """A batch input or output file cannot be read or written, or an output cannot be resumed (it exists without
    --resume, or is not a batch output)."""


class ToolError(ChatappError):
    """A tool expression was refused (used by the CLI's `calc`)."""


class ConversationError(ChatappError):
    """A conversation (list of message dicts) is malformed: unknown role, wrong order, bad content parts."""


class ContextOverflowError(ChatappError):
    """A conversation no longer fits the model's context under the 'error' policy."""


class SettingsError(ChatappError):
    """A setting has an invalid value."""


class TrainingError(ChatappError):
    """Training cannot start or resume: corpus too small for the window, unusable checkpoint or init config."""


class HistoryError(ChatappError):
    """The chat history database cannot be used: a directory, another program's database, unreadable."""


class DataDirError(ChatappError):
    """The data directory (or an output directory the app writes like it) cannot be used: a file in its place, not
    writable, or a stored file that is not a regular file."""
