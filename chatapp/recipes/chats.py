"""What the recipes' generated chats have in common: calculator calls, letter-count answers, held-out splits.

Both recipes (`tiny/corpus.py`, `smollm2/data.py`) teach the same tool: a calculator exchange is nanochat-shaped,
`[{"type": "python", ...}, {"type": "python_output", ...}, {"type": "text", ...}]` (each chat format writes it with its
own tool markers), its expression is one of two kinds (`a op b` arithmetic, `"word".count("x")` letter counting)
and its output is `chatapp.tools.calculator.evaluate`'s own text, so a model is trained on exactly what it is shown
at run time. What a recipe words around the call (questions, prefaces, answer sentences) stays with the recipe.

Held-out material is kept apart by construction: a split is `train` or `heldout`, and an item belongs to one of
them by a fixed rule (`held_out_number`, `split_list`) or by hand-partitioned lists, never by sampling luck.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from chatapp.tools.calculator import evaluate

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")

Message = dict[str, Any]

# The letter-count answer sentences both recipes train ({n} the count, {c} the letter, {w} the word); each recipe
# adds its own to these.
LETTER_COUNT_ANSWERS: tuple[str, ...] = ('There are {n} {c}\'s in "{w}".', 'The letter {c} appears {n} times in "{w}".')


@dataclass(frozen=True)
class Calculation:
    """A calculator call a generated chat makes: the expression and the calculator's output text for it."""

    expression: str
    result: str


def calculate(expression: str) -> Calculation:
    """The calculator's text for `expression`; a ValueError when it refuses (a generator bug: the recipes write only
    expressions the calculator accepts)."""
    result = evaluate(expression)
    if not result.ok or result.text is None:
        raise ValueError(f"recipe bug: the calculator refused {expression!r}: {result.reason}")
    return Calculation(expression, result.text)


def arithmetic(a: int, op: str, b: int) -> Calculation:
    """`a op b`, written without spaces (`37*45`): the canonical expression whatever the question's wording."""
    return calculate(f"{a}{op}{b}")


def letter_count(word: str, letter: str) -> Calculation:
    """`"word".count("x")`: the word is quoted in the call, so it tokenizes as in a quoted question."""
    return calculate(f'"{word}".count("{letter}")')


def is_letter_count(expression: str) -> bool:
    """Whether a calculator expression counts letters (the other kind is arithmetic)."""
    return ".count(" in expression


def tool_parts(call: Calculation, answer: str, opening: str = "") -> list[dict[str, str]]:
    """An assistant turn that calls the calculator: optional `opening` text, the call, its output, the answer."""
    parts = [
        {"type": "python", "text": call.expression},
        {"type": "python_output", "text": call.result},
        {"type": "text", "text": answer},
    ]
    return [{"type": "text", "text": opening}, *parts] if opening else parts


def tool_exchange(question: str, call: Calculation, answer: str, opening: str = "") -> list[Message]:
    """A user question and the assistant turn that answers it with the calculator (see `tool_parts`)."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": tool_parts(call, answer, opening)}]


def held_out_number(n: int) -> bool:
    """Whether the number `n` is held-out only (about one in five numbers; the rest are training only).

    A hash, not a residue: `n % 5 == 3` would make every held-out number end in 3 or 8, digits training numbers
    would then never end in, which tests an unseen final digit rather than unseen numbers.
    """
    return zlib.crc32(str(n).encode()) % 5 == 0


def split_list(items: Sequence[str], split: Split, every: int = 4, train_only: Sequence[str] = ()) -> list[str]:
    """`split`'s share of `items`: every `every`-th item (offset 1) is held-out only; the rest, and `train_only`,
    are training only."""
    held = [x for i, x in enumerate(items) if i % every == 1]
    return held if split == "heldout" else [x for x in items if x not in held] + list(train_only)
