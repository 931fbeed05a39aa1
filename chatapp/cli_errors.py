"""How the CLI reports what a user got wrong: a `ChatappError` from any command, and a Click usage error (a bad
option value, an unknown option), printed as an `error:` line and a `fix:` line on stderr, exit code 1, no traceback
and no usage box (`ChatappGroup`, the command group `chatapp.cli` builds its table on)."""

from __future__ import annotations

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
