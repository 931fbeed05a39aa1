"""Grammar constraints in the decode loop: per-row masks applied to the logits before sampling.

A row's `chatapp.trie.Constraint` (a byte DFA over token bytes, from a regex or a JSON schema) lives with the row
on the host: after the step's device→host copy it consumes the row's token, and before the next sampling its
packed mask (uint32 words, cached per DFA state by the trie package) goes to the device in one small copy for the
whole batch, where `apply_token_bitmask` sets disallowed logits to -inf. Rows without a constraint get all-ones
words, so one broadcast op serves the batch.

The model's tokens and the program's forced tokens go through the grammar; a tool's forced output does not (it is
the calculator's text, not the model's answer). A forced token the grammar rejects ends the row with finish
reason "error" and the constraint's message. Tokens the grammar leaves no choice about (its fast-forward tokens,
canonical by token healing) are not sampled at all: the engine forces them like a tool's output — flagged forced,
free of `max_tokens`, pushed through one forward when fast-forwarding. They are exactly the tokens the one-token
masks would have let through, so both paths emit the same tokens (tested).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from chatapp.errors import SettingsError


def fresh_constraint(spec: Any, build_regex: Callable[[str], Any]) -> Any:
    """A constraint in its start state for one row: a regex string is compiled; a `Constraint` is copied (rows of
    one prompt's samples must not share the grammar state)."""
    from chatapp.trie.constraint import Constraint

    if isinstance(spec, str):
        return build_regex(spec)
    if isinstance(spec, Constraint):
        return Constraint(
            spec.vocab, spec.dfa, spec.end_token, token_healing=spec.token_healing, lookback=spec.lookback
        )
    raise SettingsError(
        f"a constraint must be a regex string or a chatapp.trie Constraint, got {type(spec).__name__}",
        hint="pass the regex itself, or Constraint.regex / Constraint.json_schema",
    )


def leading_forced(program: Any) -> list[int]:
    """The tokens a TTFA program forces before the model writes anything: the first zone's feed, and the feeds of
    the forced-only zones (budget 0) that follow it."""
    tokens: list[int] = []
    zone = 0
    while zone < program.halt:
        tokens += program.zones[zone].feed
        if program.budget(zone) != 0:
            break
        zone += 1
    return tokens


def check_forced_start(program: Any, constraint: Any, *, program_name: str, constraint_name: str, drop: str) -> None:
    """`ConstraintError` before generation when `program` forces, at the start of the reply, text `constraint`
    (a `chatapp.trie` Constraint, left as it is) does not allow. The constraint holds the whole reply, forced tokens
    included, so that row could only end in an error after printing text the constraint forbids (`--program think`
    with `--regex '[0-9]+'`: `<think>`). A conflict later in the reply depends on what the model writes; the row
    then ends with the constraint's error. `drop`: what the user may leave out, e.g. "--program or --regex"."""
    from chatapp.errors import ConstraintError
    from chatapp.trie.constraint import shown_text
    from chatapp.trie.token_bytes import SPECIAL_TOKEN_MARKER

    probe = fresh_constraint(constraint, lambda pattern: None)
    forced = leading_forced(program)
    for token in forced:
        try:
            probe.consume(token)
        except ConstraintError:
            text = "".join(shown_text(constraint.vocab.token_bytes(t)) for t in forced)
            refused = constraint.vocab.token_bytes(token)
            if refused[:1] == bytes([SPECIAL_TOKEN_MARKER]):  # a constraint over text never matches a special token's bytes
                fix = f"drop {drop}: no constraint allows the special token {shown_text(refused)!r}"
            else:
                fix = f"drop {drop}, or change the constraint to allow {text!r} at the start"
            raise ConstraintError(
                f"{program_name} starts the reply with the forced text {text!r}, which {constraint_name} does not "
                "allow (the constraint holds the whole reply, forced text included)",
                hint=fix,
            ) from None


def apply_masks(logits: torch.Tensor, constraints: Sequence[Any | None], vocab_size: int) -> None:
    """Mask `logits` (B, V) in place with each row's allowed tokens (rows with None are left alone)."""
    from chatapp.trie.bitmask import apply_token_bitmask
    from chatapp.trie.constraint import batch_bitmask

    apply_token_bitmask(logits, batch_bitmask(constraints, vocab_size))
