"""The Token-Triggered Finite Automaton: programs that script a turn in zones, run batched on the device.

Write a program in TOML (or with `ProgramBuilder`), compile it for a tokenizer (`load_program`), and run a batch
of rows with `Automaton`; `disassemble` prints what the automaton will do. `docs/ttfa.md` describes it;
`program.py` states the semantics precisely and `reference.py` executes them one row at a time.
"""

from typing import TYPE_CHECKING, Any

from chatapp.ttfa.compiler import compile_program
from chatapp.ttfa.disasm import disassemble
from chatapp.ttfa.loader import BUILTIN_PROGRAMS, load_program, program_path
from chatapp.ttfa.program import Program, Zone
from chatapp.ttfa.source import Contains, ProgramBuilder, ProgramSource, ZoneSource, parse_program_toml

if TYPE_CHECKING:
    from chatapp.ttfa.automaton import Automaton, TTFAState, ttfa_advance, ttfa_step

# The automaton runs on torch tensors; reading, checking and compiling a program do not. Its names are imported on
# first use, so that the TUI's own process (which checks `--program` before the engine process has loaded torch)
# and `chatapp program check` never import torch.
_AUTOMATON = frozenset({"Automaton", "TTFAState", "ttfa_advance", "ttfa_step"})


def __getattr__(name: str) -> Any:
    if name in _AUTOMATON:
        from chatapp.ttfa import automaton

        return getattr(automaton, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN_PROGRAMS",
    "Automaton",
    "Contains",
    "Program",
    "ProgramBuilder",
    "ProgramSource",
    "TTFAState",
    "Zone",
    "ZoneSource",
    "compile_program",
    "disassemble",
    "load_program",
    "parse_program_toml",
    "program_path",
    "ttfa_advance",
    "ttfa_step",
]
