"""How the CLI reports what a user got wrong: a `ChatappError` from any command, and a Click usage error (a bad
option value, an unknown option), printed as an `error:` line and a `fix:` line on stderr, exit code 1, no traceback
and no usage box (`ChatappGroup`, the command group `chatapp/cli/table.py` builds its table on)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from chatapp.errors import ChatappError, SettingsError, user_message

# The Click that parses: typer 0.2x's own copy, Click itself before it (importing Click beside typer's copy would
# cost `chatapp --help` a tenth of its time for exceptions that are never raised).
try:
    from typer._click import Context
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import Context
    from click import exceptions as click_errors
_USAGE_ERRORS = (click_errors.UsageError,)
_NO_ARGS_IS_HELP = tuple(kind for kind in (getattr(click_errors, "NoArgsIsHelpError", None),) if kind)
_NO_SUCH_OPTION = (click_errors.NoSuchOption,)


class ChatappGroup(TyperGroup):
    """The command group: a `ChatappError` from any command, and a usage error (a bad option value, an unknown
    option), is printed as one message (no traceback, no usage box) and exits with its code (1), so commands just
    raise. `user_error` is the one place that turns an exception into that message and its fix."""

    def make_context(self, info_name: str | None, args: list[str], parent=None, **extra: Any) -> Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except _USAGE_ERRORS as err:
            if isinstance(err, _NO_ARGS_IS_HELP):
                raise
            raise fail(user_error(err)) from None

    def invoke(self, ctx: Context) -> Any:
        words = [*getattr(ctx, "_protected_args", ()), *ctx.args]  # before the group consumes them
        try:
            from chatapp.settings import check_spin_count

            check_spin_count()  # every command may load torch (and libgomp, which reads it once)
            return super().invoke(ctx)
        except (ChatappError, *_USAGE_ERRORS) as err:
            if isinstance(err, _NO_ARGS_IS_HELP):
                raise
            raise fail(user_error(err, command=self._command_named(ctx, words))) from None

    def _command_named(self, ctx: Context, words: list[str]) -> str:
        """The command path `words` name (`chatapp program show`): Click raises some usage errors (an option
        without its value) without the context that knows it."""
        path, command = [ctx.command_path], self
        for word in words:
            sub = command.get_command(ctx, word) if hasattr(command, "get_command") else None
            if sub is None:
                break
            path.append(word)
            command = sub
        return " ".join(path)


def user_error(err: Exception, *, command: str = "chatapp") -> ChatappError:
    """The message and fix for an exception a user caused: a `ChatappError` as it is, a Click usage error as a
    `SettingsError` (one line and the --help of its command, or of `command` when Click did not say which, where
    Click would print its usage box and exit 2)."""
    if isinstance(err, ChatappError):
        return err
    if isinstance(err, _NO_SUCH_OPTION) and not err.option_name.startswith("--"):
        hint = "an argument that starts with '-' goes after --, e.g. `chatapp calc -- '-5+3'`"
    else:
        command = err.ctx.command_path if getattr(err, "ctx", None) is not None else command
        hint = f"see `{command} --help`"
    usage = SettingsError(err.format_message(), hint=hint)
    usage.exit_code = 1
    return usage


err_console = Console(stderr=True, highlight=False)


def fail(err: ChatappError) -> typer.Exit:
    """Print a user-caused error as its `error:` line and its `fix:` line, and return the Exit to raise."""
    shown = user_message(err)
    # Messages quote user input (expressions, paths) that may contain "[...]": escape it so Rich prints it as-is.
    err_console.print(f"[bold red]error:[/] {escape(shown.error)}", markup=True, soft_wrap=True)
    err_console.print(f"[bold]fix:[/] {escape(shown.fix)}", markup=True, soft_wrap=True)
    return typer.Exit(code=err.exit_code)


# ------------------------------------------------------------------------------------------------------ stdout
# Every command's output goes to stdout through Rich, typer.echo, print or the batch sink, and any of them can find
# stdout broken: redirected to a full disk (ENOSPC), a reader gone (EPIPE), or closed before the process started
# (`>&-`: Python then sets `sys.stdout` to None, and the first write is an AttributeError). Rather than teach every
# writer, `guard_stdout` puts one wrapper in `sys.stdout` whose failures are all `StdoutError`, and the entry point
# (`chatapp.cli.main`, in `table.py`) turns that into one `error:` line on stderr and exit status 1, for every command.
class StdoutError(OSError):
    """Writing to stdout failed. Its errno is None on purpose: Click swallows an OSError whose errno is EPIPE
    (exit 1, not a word), and the message must reach the entry point. `cause` is the original error."""

    def __init__(self, cause: BaseException | None) -> None:
        self.cause = cause
        super().__init__(None, _stdout_problem(cause))


class StdoutPipeError(StdoutError, BrokenPipeError):
    """stdout's reader went away (EPIPE); a `BrokenPipeError`, as writers that handle that case expect."""


def _stdout_problem(cause: BaseException | None) -> str:
    if cause is None:
        return "stdout is closed"
    if isinstance(cause, BrokenPipeError):
        return "stdout's reader went away before all the output was written"
    if isinstance(cause, OSError) and cause.strerror:
        return cause.strerror
    return str(cause) or type(cause).__name__


def _stdout_error(cause: BaseException | None) -> StdoutError:
    if isinstance(cause, StdoutError):
        return cause
    return StdoutPipeError(cause) if isinstance(cause, BrokenPipeError) else StdoutError(cause)


class _GuardedStdout:
    """`sys.stdout` as it was, whose write and flush failures are `StdoutError`s; everything else is the stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError) as err:  # ValueError: the stream was closed under us
            raise _stdout_error(err) from None

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError) as err:
            raise _stdout_error(err) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _ClosedStdout(_GuardedStdout):
    """What `sys.stdout` is when the process started with its stdout closed: every write fails, saying so."""

    def __init__(self) -> None:
        super().__init__(None)

    def write(self, text: str) -> int:
        raise StdoutError(None)

    def flush(self) -> None:
        pass  # nothing was written, so nothing is lost

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise StdoutError(None)

    def __getattr__(self, name: str) -> Any:
        if name in ("encoding", "errors"):
            return "utf-8" if name == "encoding" else "strict"
        raise AttributeError(name)


def guard_stdout() -> None:
    """Put the guard in `sys.stdout` (once). A closed file descriptor 1 is first given /dev/null, so that no file
    this process opens later gets descriptor 1 and receives what is meant for stdout."""
    if isinstance(sys.stdout, _GuardedStdout):
        return
    try:
        os.fstat(1)
        closed = sys.stdout is None
    except OSError:
        closed = True
    if not closed:
        sys.stdout = _GuardedStdout(sys.stdout)
        return
    _point_at_devnull()
    sys.stdout = _ClosedStdout()


def _point_at_devnull() -> None:
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        if devnull != 1:
            os.dup2(devnull, 1)
            os.close(devnull)


def stdout_failed(err: StdoutError) -> int:
    """Report a broken stdout as one `error:` line and its fix on stderr, make sure no later flush (the exit's)
    tries it again, and return the exit status (1)."""
    if isinstance(err, StdoutPipeError):
        hint = "keep reading until the command ends, or redirect stdout to a file (> out.txt) and read that"
    elif err.cause is None:
        hint = "run the command with stdout open: redirect it to a file (> out.txt) or to /dev/null"
    else:
        hint = "free space where stdout goes, or redirect it to a file on another disk (> /other/disk/out.txt)"
    problem = err.strerror or "stdout cannot be written"
    what = problem if err.cause is None or isinstance(err, StdoutPipeError) else f"cannot write to stdout: {problem}"
    _point_at_devnull()
    sys.stdout = _ClosedStdout()
    with contextlib.suppress(OSError, ValueError):
        fail(ChatappError(what, hint=hint))
    return 1
