"""`chatapp program show|check`: a TTFA program compiled for a model's tokenizer, or its first error."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

err_console = Console(stderr=True, highlight=False)

program_app = typer.Typer(help="TTFA programs: show a compiled program, check a program file.", no_args_is_help=True)

TokenizerOption = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        help="A tokenizer.json, a model directory or a model name (tiny) to compile for (default: the default "
        "model's).",
    ),
]


def _program_tokenizer(tokenizer: str | None):
    """The tokenizer a program is compiled for (a tokenizer.json, a model directory or name, or the default model's)
    and, for a model directory, its chat format's token-name aliases."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from chatapp.errors import ModelDirError
    from chatapp.models.registry import is_registered, resolve_model

    path = resolve_model(tokenizer) if is_registered(tokenizer) else Path(str(tokenizer)).expanduser()
    model_dir = path if path.is_dir() else None
    if model_dir is not None:
        path = path / "tokenizer.json"
    try:
        loaded = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for missing or malformed files
        raise ModelDirError(
            f"cannot read tokenizer {path}: {err}", hint="pass --tokenizer PATH (a tokenizer.json or a model directory)"
        ) from None
    aliases: dict[str, str] = {}
    if model_dir is not None:
        from chatapp.chat import chat_format_for

        try:
            aliases = chat_format_for(loaded, model_dir).program_aliases
        except ModelDirError:  # no chat format: the program's names are taken as they are
            aliases = {}
    return loaded, aliases


@program_app.command("show")
def program_show(
    program: Annotated[str, typer.Argument(help="A built-in program (chat, think, calc, json) or a .toml file.")],
    tokenizer: TokenizerOption = None,
) -> None:
    """Print a compiled program, one zone per line: feed tokens, triggers, jumps, budgets, tags."""
    from chatapp.ttfa import disassemble, load_program

    vocab, aliases = _program_tokenizer(tokenizer)
    compiled = load_program(program, vocab, aliases)
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

    compiled = load_program(file, *_program_tokenizer(tokenizer))
    for warning in compiled.warnings:
        err_console.print(f"warning: {warning}", markup=False, soft_wrap=True)
    typer.echo(f"ok: {compiled.name} ({len(compiled.zones)} zones, {len(compiled.warnings)} warnings)")
