"""`think` on a tokenizer without single `<think>` / `</think>` tokens compiles from its text-marker variant."""

from __future__ import annotations

import pytest

from chatapp.errors import ProgramError
from chatapp.ttfa import load_program
from chatapp.ttfa.loader import PROGRAMS_DIR, TEXT_MARKER_VARIANTS
from chatapp.ttfa.source import load_program_source


def test_think_compiles_from_its_text_variant_when_the_tokenizer_lacks_think_tokens(chat_tokenizer) -> None:
    assert chat_tokenizer.token_to_id("</think>") is None
    with pytest.raises(ProgramError):  # the built-in itself needs a single `</think>` token
        from chatapp.ttfa.compiler import compile_program

        compile_program(load_program_source(PROGRAMS_DIR / "think.toml"), chat_tokenizer)
    program = load_program("think", chat_tokenizer)
    assert program.name == "think"
    assert [zone.label for zone in program.zones][:2] == ["think", "answer"]
    assert chat_tokenizer.decode(list(program.data[:3]), skip_special_tokens=False).startswith("<")


def test_a_tokenizer_with_think_tokens_keeps_the_builtin() -> None:
    from tokenizers import Tokenizer

    tiny = Tokenizer.from_file(str(PROGRAMS_DIR.parent.parent / "models" / "tiny" / "tokenizer.json"))
    program = load_program("think", tiny)
    assert list(program.data[:1]) == [tiny.token_to_id("<think>")]
    assert set(TEXT_MARKER_VARIANTS) == {"think"}
