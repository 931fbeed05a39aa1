"""The compiler: built-in goldens, one test per error (with file, line and zone), warnings, builder == TOML."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chatapp.errors import ProgramError
from chatapp.ttfa import (
    BUILTIN_PROGRAMS,
    Contains,
    ProgramBuilder,
    compile_program,
    disassemble,
    load_program,
    parse_program_toml,
)
from chatapp.ttfa.vocab import TokenVocab

GOLDENS = Path(__file__).with_name("goldens")


@pytest.mark.parametrize("name", BUILTIN_PROGRAMS)
def test_builtin_disassembly_matches_golden(name: str, ttfa_tokenizer) -> None:
    """Set UPDATE_GOLDENS=1 to rewrite them after an intended change (and review the diff)."""
    program = load_program(name, ttfa_tokenizer)
    text = disassemble(program, ttfa_tokenizer) + "\n"
    golden = GOLDENS / f"{name}.txt"
    if os.environ.get("UPDATE_GOLDENS"):
        golden.write_text(text)
    assert text == golden.read_text()
    assert program.warnings == ()


def compile_toml(text: str, tokenizer, file: str = "prog.toml"):
    return compile_program(parse_program_toml(text, file=file), tokenizer)


ZONE = """
[[zones]]
label = "one"
force = "Hi"
until = "<|assistant_end|>"
tags = ["a"]
"""
HEADER = 'name = "t"\ntags = ["a"]\n'

# (program text, expected message fragment, expected line, expected zone)
ERRORS = {
    "toml syntax": ('name = "t\n', "not valid TOML", 1, None),
    "no zones": (HEADER, "declares no [[zones]]", None, None),
    "unknown program key": ('nmae = "t"\n' + ZONE, "unknown key 'nmae'", 1, None),
    "unknown zone key": (HEADER + ZONE + 'untill = "x"\n', "unknown key 'untill'", 9, "one"),
    "wrong type": (HEADER + ZONE + 'budget = "ten"\n', "budget must be an integer", 9, "one"),
    "program key type": ('name = "t"\ntags = "a"\n' + ZONE, "tags must be a list of strings", 2, None),
    "missing label": (HEADER + '\n[[zones]]\nforce = "Hi"\nuntil = "!"\n', "the zone has no label", 4, None),
    "zones not tables": (HEADER + "zones = [1, 2]\n", "declares no [[zones]]", 3, None),
    "duplicate label": (HEADER + ZONE + ZONE, "label 'one' is used by two zones", 11, "one"),
    "reserved label": (HEADER + ZONE.replace('"one"', '"halt"'), "'halt' is reserved", 5, "halt"),
    "goto unknown label": (
        HEADER + ZONE + 'jump_on = "!"\ngoto = "nowhere"\n',
        "goto 'nowhere' names no zone",
        10,
        "one",
    ),
    "jump_on without goto": (HEADER + ZONE + 'jump_on = "!"\n', "jump_on needs goto", 9, "one"),
    "goto without jump_on": (HEADER + ZONE + 'goto = "one"\n', "goto needs jump_on", 9, "one"),
    "undeclared tag": (HEADER + ZONE.replace('["a"]', '["b"]'), "tag 'b' is not declared", 8, "one"),
    "tag declared twice": ('name = "t"\ntags = ["a", "a"]\n' + ZONE, "tag 'a' is declared twice", 2, None),
    "trigger is several tokens": (
        HEADER + ZONE.replace('until = "<|assistant_end|>"', 'until = "strawberry letters"'),
        "until 'strawberry letters' is not a single token",
        7,
        "one",
    ),
    "contains matches nothing": (
        HEADER + ZONE.replace('until = "<|assistant_end|>"', 'until = {contains = "§"}'),
        "no token contains '§'",
        7,
        "one",
    ),
    "timeout token is several tokens": (
        HEADER + ZONE + 'timeout_token = "strawberry letters"\n',
        "timeout_token 'strawberry letters' is not a single token",
        9,
        "one",
    ),
    "negative budget": (HEADER + ZONE + "budget = -1\n", "budget must be >= 0", 9, "one"),
    "budget within the feed": (HEADER + ZONE + "budget = 1\n", "budget 1 leaves no token for the model", 9, "one"),
    "default budget within the feed": (
        'name = "t"\ntags = ["a"]\nmax_genned_per_zone = 1\n' + ZONE,
        "budget 1 leaves no token for the model",
        7,
        "one",
    ),
    "forced-only without text": (
        HEADER + '\n[[zones]]\nlabel = "x"\nbudget = 0\n',
        "needs forced text",
        6,
        "x",
    ),
    "forced-only with a trigger": (
        HEADER + ZONE + "budget = 0\n",
        "until has no effect in a forced-only zone",
        7,
        "one",
    ),
    "zone never ends": (HEADER + '\n[[zones]]\nlabel = "x"\nforce = "Hi"\n', "the zone never ends", 4, "x"),
    "jump-only zone that can time out": (
        HEADER + '\n[[zones]]\nlabel = "x"\njump_on = "!"\ngoto = "halt"\nbudget = 5\n',
        "can time out but has no until token",
        4,
        "x",
    ),
    "max_genned_per_zone below 1": (
        'name = "t"\ntags = ["a"]\nmax_genned_per_zone = 0\n' + ZONE,
        "max_genned_per_zone must be at least 1",
        3,
        None,
    ),
    "pad is not a token": ('name = "t"\ntags = ["a"]\npad = "no such token"\n' + ZONE, "pad 'no such token'", 3, None),
}


@pytest.mark.parametrize("case", ERRORS)
def test_compile_error_names_file_line_and_zone(case: str, ttfa_tokenizer) -> None:
    text, fragment, line, zone = ERRORS[case]
    with pytest.raises(ProgramError) as caught:
        compile_toml(text, ttfa_tokenizer)
    err = caught.value
    assert fragment in err.message
    assert (err.file, err.line, err.zone) == ("prog.toml", line, zone)
    assert err.message.startswith("prog.toml" + (f":{line}" if line else ""))
    assert err.hint, "every compile error says how to fix it"


def test_contains_without_an_exact_token_needs_a_timeout_token(ttfa_tokenizer) -> None:
    vocab = TokenVocab(ttfa_tokenizer)
    # A piece of some token's text that is not a token of its own.
    needle = next(
        text[:2]
        for i, text in enumerate(vocab.texts)
        if len(text) > 2 and text[:2].isalpha() and i not in vocab.special_ids and vocab.token(text[:2]) is None
    )
    text = HEADER + ZONE.replace('until = "<|assistant_end|>"', f'until = {{contains = "{needle}"}}')
    with pytest.raises(ProgramError, match="timeout_token") as caught:
        compile_toml(text, ttfa_tokenizer)
    assert caught.value.line == 7
    fixed = compile_toml(text + 'timeout_token = "<|assistant_end|>"\n', ttfa_tokenizer)
    assert fixed.zones[0].until == frozenset(vocab.containing(needle))


def test_missing_files_and_unknown_names(tmp_path: Path, ttfa_tokenizer) -> None:
    with pytest.raises(ProgramError, match="no built-in program named 'thinking'"):
        load_program("thinking", ttfa_tokenizer)
    with pytest.raises(ProgramError, match="does not exist"):
        load_program(tmp_path / "missing.toml", ttfa_tokenizer)


def test_program_file_loads_by_path_and_reports_its_path(tmp_path: Path, ttfa_tokenizer) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(HEADER + ZONE + "budget = 1\n")
    with pytest.raises(ProgramError) as caught:
        load_program(path, ttfa_tokenizer)
    assert str(caught.value).startswith(f"{path}:9: zone 'one': ")
    path.write_text(HEADER + ZONE)
    assert load_program(path, ttfa_tokenizer).name == "t"


def test_trailing_space_is_warned(ttfa_tokenizer) -> None:
    program = compile_toml(HEADER + ZONE.replace('force = "Hi"', 'force = "The answer is "'), ttfa_tokenizer)
    assert len(program.warnings) == 1
    assert "prog.toml:6: zone 'one'" in program.warnings[0] and "'the'" in program.warnings[0]


def test_forced_text_is_tokenized_after_the_forced_text_before_it(ttfa_tokenizer) -> None:
    """Two forced-only zones are one run of text: the second is tokenized as it continues the first."""
    vocab = TokenVocab(ttfa_tokenizer)
    source = (
        ProgramBuilder("split", tags=[])
        .zone("a", force="The answer", budget=0)
        .zone("b", force=" is 4.", until="<|assistant_end|>")
        .build()
    )
    program = compile_program(source, ttfa_tokenizer)
    assert list(program.data) == vocab.encode("The answer is 4.")
    assert program.warnings == ()
    # Splitting inside a word: the second half cannot be canonical, and the compiler says so.
    merged = ProgramBuilder("w").zone("a", force="strawb", budget=0).zone("b", force="erry", until="!").build()
    warnings = compile_program(merged, ttfa_tokenizer).warnings
    assert any("merges with the 'strawb' before it" in w for w in warnings)


def test_builder_compiles_like_toml(ttfa_tokenizer) -> None:
    built = (
        ProgramBuilder("think", tags=["think", "answer"], pad="<|assistant_end|>")
        .zone("think", force="<think>", until="</think>", budget=256, tags=["think"])
        .zone("answer", until="<|assistant_end|>", tags=["answer"])
        .build()
    )
    from_builder = compile_program(built, ttfa_tokenizer)
    assert disassemble(from_builder, ttfa_tokenizer) == disassemble(
        load_program("think", ttfa_tokenizer), ttfa_tokenizer
    )


def test_token_sets_and_jump_precedence(ttfa_tokenizer) -> None:
    vocab = TokenVocab(ttfa_tokenizer)
    source = (
        ProgramBuilder("sets", tags=[])
        .zone("a", until=Contains('"'), jump_on=Contains('",'), goto="halt", timeout_token='"')
        .zone("b", until=[".", "!"])
        .build()
    )
    program = compile_program(source, ttfa_tokenizer)
    a, b = program.zones
    assert a.until == frozenset(vocab.containing('"')) and a.jump_on == frozenset(vocab.containing('",'))
    assert a.jump_on and a.jump_on < a.until  # overlapping: the linker gives the jump precedence
    assert a.jump_to == program.halt
    assert b.until == {vocab.token("."), vocab.token("!")} and b.timeout_token == vocab.token(".")
