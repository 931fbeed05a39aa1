"""The Token-Triggered Finite Automaton: programs that script a turn in zones, run batched on the device.

Write a program in TOML (or with `ProgramBuilder`), compile it for a tokenizer (`load_program`), and run a batch
of rows with `Automaton`; `disassemble` prints what the automaton will do. `seeds/ttfa.md` is the specification;
`program.py` states the semantics precisely and `reference.py` executes them one row at a time.
"""

from chatapp.ttfa.automaton import Automaton, TTFAState, ttfa_advance, ttfa_step
from chatapp.ttfa.compiler import compile_program
from chatapp.ttfa.disasm import disassemble
from chatapp.ttfa.loader import BUILTIN_PROGRAMS, load_program, program_path
from chatapp.ttfa.program import Program, Zone
from chatapp.ttfa.source import Contains, ProgramBuilder, ProgramSource, ZoneSource, parse_program_toml

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
