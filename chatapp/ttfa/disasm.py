"""Printing a compiled program one zone per line, with token ids, as the automaton will run it."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer

from chatapp.ttfa.program import UNLIMITED, Program
from chatapp.ttfa.vocab import TokenVocab

MAX_SET_SHOWN = 6


def disassemble(program: Program, tokenizer: Tokenizer) -> str:
    """`program` as text: a header, then `index label feed until jump timeout budget tags` per zone, then HALT."""
    vocab = TokenVocab(tokenizer)
    width = max([len(zone.label) for zone in program.zones] + [4])
    default = "none" if program.max_genned_per_zone is None else str(program.max_genned_per_zone)
    lines = [
        f"program {program.name}: {len(program.zones)} zones, tags [{', '.join(program.tag_names)}], "
        f"pad {_token(vocab, program.pad)}, max_genned_per_zone {default}"
    ]
    for index, zone in enumerate(program.zones):
        budget = program.budget(index)
        parts = [f"{index:>3} {zone.label:<{width}}"]
        parts.append(f"feed[{program.start(index)}:{program.end(index)}] {_tokens(vocab, zone.feed)}")
        if budget == 0:
            parts.append("forced-only")
        else:
            if zone.until:
                parts.append(f"until {_token_set(vocab, zone.until)}")
            if zone.jump_to is not None:
                target = "halt" if zone.jump_to == program.halt else program.zones[zone.jump_to].label
                parts.append(f"jump {_token_set(vocab, zone.jump_on)} -> {zone.jump_to} {target}")
            timeout = zone.timeout_token if zone.timeout_token is not None else program.pad
            parts.append(f"budget {'none' if budget == UNLIMITED else budget} timeout {_token(vocab, timeout)}")
        parts.append(f"tags [{', '.join(zone.tags)}]")
        lines.append("  ".join(parts))
    lines.append(f"{program.halt:>3} {'halt':<{width}}  emits pad")
    return "\n".join(lines)


def _token(vocab: TokenVocab, token: int) -> str:
    return f"{vocab.show(token)}#{token}"


def _tokens(vocab: TokenVocab, tokens: Iterable[int]) -> str:
    return "[" + " ".join(_token(vocab, t) for t in tokens) + "]"


def _token_set(vocab: TokenVocab, tokens: Iterable[int]) -> str:
    ordered = sorted(tokens)
    shown = " ".join(_token(vocab, t) for t in ordered[:MAX_SET_SHOWN])
    more = f" +{len(ordered) - MAX_SET_SHOWN} more" if len(ordered) > MAX_SET_SHOWN else ""
    return "{" + shown + more + "}"
