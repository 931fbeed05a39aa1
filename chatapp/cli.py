"""The `chatapp` command line: one Typer command per function.

Heavy imports (torch, transformers, textual) happen inside the commands so `chatapp --help` stays instant.
User-caused errors are `ChatappError`s: printed as one clear message on stderr, exit code 1, no traceback.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

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
    # Messages quote user input (expressions, paths) that may contain "[...]": escape it so Rich prints it as-is.
    err_console.print(f"[bold red]error:[/] {escape(err.message)}", markup=True, soft_wrap=True)
    if err.hint:
        err_console.print(f"[bold]fix:[/] {escape(err.hint)}", markup=True, soft_wrap=True)
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


@app.command()
def info() -> None:
    """Show versions, the compute device, and where config, data, history and the default model live."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from chatapp.settings import config_dir, data_dir, default_model_dir, history_db_path

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} GPU(s))"
    else:
        device = f"cpu ({torch.get_num_threads()} threads)"
    model_dir = default_model_dir()
    # A usable checkpoint has its config, tokenizer and weights; anything less is reported as missing.
    present = (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    present = present and any(model_dir.glob("*.safetensors"))
    rows = {
        "chatapp": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": installed("transformers"),
        "textual": installed("textual"),
        "device": device,
        "config dir": str(config_dir()),
        "data dir": str(data_dir()),
        "history db": str(history_db_path()),
        "default model": f"{model_dir} ({'present' if present else 'missing'})",
    }
    for key, value in rows.items():
        typer.echo(f"{key + ':':<15}{value}")


@app.command()
def calc(
    expression: Annotated[
        str,
        typer.Argument(help='Arithmetic such as "37*45" or \'"strawberry".count("r")\'; put -- before a leading -.'),
    ],
) -> None:
    """Evaluate an expression with the model's inline calculator (same rules, same output text)."""
    from chatapp.errors import ToolError
    from chatapp.tools import CALCULATOR

    result = CALCULATOR.run(expression)
    if not result.ok:
        shown = expression if len(expression) <= 80 else expression[:77] + "..."
        err = ToolError(
            f"the calculator refused {shown!r}: {result.reason}",
            hint='use numbers, + - * / // %, parentheses and "text".count("x")',
        )
        raise fail(err) from None
    typer.echo(result.text)


program_app = typer.Typer(help="TTFA programs: show a compiled program, check a program file.", no_args_is_help=True)
app.add_typer(program_app, name="program")

TokenizerOption = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        help="A tokenizer.json, or a model directory holding one, to compile for (default: the default model's).",
    ),
]


def _program_tokenizer(tokenizer: str | None):
    """The tokenizer a program is compiled for: a tokenizer.json, a model directory, or the default model's."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from chatapp.errors import ModelDirError
    from chatapp.settings import default_model_dir

    path = Path(tokenizer).expanduser() if tokenizer else default_model_dir()
    if path.is_dir():
        path = path / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for missing or malformed files
        raise ModelDirError(
            f"cannot read tokenizer {path}: {err}", hint="pass --tokenizer PATH (a tokenizer.json or a model directory)"
        ) from None


@program_app.command("show")
def program_show(
    program: Annotated[str, typer.Argument(help="A built-in program (chat, think, calc, json) or a .toml file.")],
    tokenizer: TokenizerOption = None,
) -> None:
    """Print a compiled program, one zone per line: feed tokens, triggers, jumps, budgets, tags."""
    from chatapp.ttfa import disassemble, load_program

    try:
        vocab = _program_tokenizer(tokenizer)
        compiled = load_program(program, vocab)
    except ChatappError as err:
        raise fail(err) from None
    typer.echo(disassemble(compiled, vocab))
    for warning in compiled.warnings:
        err_console.print(f"warning: {warning}", markup=False, soft_wrap=True)


@program_app.command("check")
def program_check(
    file: Annotated[str, typer.Argument(help="The .toml program file (or a built-in name) to check.")],
    tokenizer: TokenizerOption = None,
) -> None:
    """Compile a program and report `ok` (plus any warnings), or its first error as FILE:LINE (exit code 1)."""
    from chatapp.ttfa import load_program

    try:
        compiled = load_program(file, _program_tokenizer(tokenizer))
    except ChatappError as err:
        raise fail(err) from None
    for warning in compiled.warnings:
        err_console.print(f"warning: {warning}", markup=False, soft_wrap=True)
    typer.echo(f"ok: {compiled.name} ({len(compiled.zones)} zones, {len(compiled.warnings)} warnings)")


@app.command()
def run(
    model: Annotated[
        str | None, typer.Option("--model", help="Model directory (default: the embedded default model).")
    ] = None,
    program: Annotated[
        str | None,
        typer.Option("--program", help="TTFA program: a built-in name (chat, think, calc, json) or a .toml file."),
    ] = None,
    db: Annotated[
        str | None, typer.Option("--db", help="Chat history database (default: history.sqlite3 in the data dir).")
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu, cuda, cuda:N or auto (default).")] = None,
) -> None:
    """Open the chat TUI: streamed tokens (sampled vs forced), zone tags, routing heatmap, tool calls, history."""
    from pathlib import Path

    from chatapp.ui import make_app

    try:
        chat = make_app(
            model_dir=Path(model).expanduser() if model else None,
            program=program,
            db_path=Path(db).expanduser() if db else None,
            device=device,
        )
    except ChatappError as err:
        raise fail(err) from None
    chat.run()


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
