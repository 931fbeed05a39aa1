"""Finding programs by name (the built-ins shipped under `programs/`) or by path, and compiling them."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from tokenizers import Tokenizer

from chatapp.errors import ProgramError
from chatapp.ttfa.compiler import ProgramBudget, compile_program
from chatapp.ttfa.program import Program
from chatapp.ttfa.source import ProgramSource, load_program_source

PROGRAMS_DIR = Path(__file__).with_name("programs")
BUILTIN_PROGRAMS: tuple[str, ...] = ("chat", "think", "calc", "json")
# A built-in whose marker tokens a tokenizer may lack, and the variant that writes those markers as text instead
# (compiled when the built-in itself does not compile for the tokenizer, e.g. SmolLM2 has no `</think>` token).
TEXT_MARKER_VARIANTS: dict[str, str] = {"think": "think_text"}


def program_path(name_or_path: str | Path) -> Path:
    """The file behind a built-in name or a path; raises `ProgramError` if there is none."""
    if str(name_or_path) in BUILTIN_PROGRAMS:
        return PROGRAMS_DIR / f"{name_or_path}.toml"
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.suffix == ".toml" or path.parent != Path("."):
        raise ProgramError(f"program file {path} does not exist", hint="pass a built-in name or a .toml path")
    raise ProgramError(
        f"no built-in program named {str(name_or_path)!r}",
        hint=f"use one of {', '.join(BUILTIN_PROGRAMS)}, or the path of a .toml program file",
    )


def load_program_source_by_name(name_or_path: str | Path) -> ProgramSource:
    """The parsed (not yet compiled) program named `name_or_path`."""
    return load_program_source(program_path(name_or_path))


def load_program(
    name_or_path: str | Path,
    tokenizer: Tokenizer,
    aliases: Mapping[str, str] | None = None,
    budget: ProgramBudget | None = None,
) -> Program:
    """Load a built-in program by name (chat, think, calc, json) or a `.toml` file, compiled for `tokenizer` within
    `budget`; a chat format's `program_aliases` let a program written with nanochat's token names run on its model.

    A built-in that names marker tokens the tokenizer lacks (`think` on SmolLM2) is compiled from its text-marker
    variant (`TEXT_MARKER_VARIANTS`); when that fails too, the built-in's own error is raised, saying why."""
    try:
        return compile_program(load_program_source_by_name(name_or_path), tokenizer, aliases, budget)
    except ProgramError as err:
        variant = TEXT_MARKER_VARIANTS.get(str(name_or_path))
        if variant is None:
            raise
        try:
            return compile_program(load_program_source(PROGRAMS_DIR / f"{variant}.toml"), tokenizer, aliases, budget)
        except ProgramError:
            raise err from None
