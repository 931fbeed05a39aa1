"""The `chatapp` command line: one Typer command per function.

Heavy imports (torch, transformers, textual) happen inside the commands so `chatapp --help` stays instant.
User-caused errors are `ChatappError`s: printed as one clear message on stderr, exit code 1, no traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console

from chatapp import __version__
from chatapp.errors import ChatappError

app = typer.Typer(
    name="chatapp",
    help="Watch a small language model think: sampled vs forced tokens, TTFA zones, STT routing, inline tools.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True, highlight=False)


def fail(err: ChatappError) -> typer.Exit:
    """Print a user-caused error and return the Exit to raise."""
    err_console.print(f"[bold red]error:[/] {err.message}", markup=True, soft_wrap=True)
    if err.hint:
        err_console.print(f"[bold]fix:[/] {err.hint}", markup=True, soft_wrap=True)
    return typer.Exit(code=err.exit_code)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"chatapp {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_version_callback, is_eager=True)
    ] = False,
) -> None:
    """chatapp: a terminal tool for watching a language model think while it talks."""


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except ChatappError as err:  # raised outside a command's own handling
        raise SystemExit(fail(err).exit_code) from None
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()
