"""`Constraint`: one row's grammar state over tokens — masks, consumption, forced and fast-forward tokens.

A constraint is a byte DFA (from a regex or a JSON schema) plus the current DFA state. Its mask allows the tokens
whose bytes keep the DFA alive, plus the end-of-turn token once the output is complete. Masks are cached per
(DFA, state, healing prefix) in the shared `ConstraintVocab`, so rows in the same state share one walk.

Forced bytes (`forced_bytes()`) become fast-forward tokens (`ff_tokens()`, see `fast_forward.py`). While there are
any, the mask allows only the first of them, as llguidance does, so an engine that samples step by step emits the
same tokens as one that forces them in one go.

Token healing: the forced bytes that fast-forward leaves untokenized (they could start a longer token, e.g.
`order` with `orderId` in the vocabulary, or the `"` of `":`) must be the prefix of the next token: the mask then
allows only tokens starting with them, so the model picks the canonical continuation (`orderId`, `":`) instead of
a split it never saw (`o`, `or`, …, which llguidance's plain mask still allows). If no token starts with them
the plain mask applies. This is a function of the DFA state and the previous token, so it needs no bookkeeping
beyond them. `token_healing=False` gives llguidance's masks exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from chatapp.errors import ConstraintError
from chatapp.trie.budget import metered
from chatapp.trie.dfa import DEAD, ByteDFA
from chatapp.trie.fast_forward import LOOKBACK_TOKENS, FastForward, fast_forward
from chatapp.trie.json_schema import schema_to_regex
from chatapp.trie.regex import compile_regex
from chatapp.trie.token_bytes import SPECIAL_TOKEN_MARKER
from chatapp.trie.vocab import ConstraintVocab

_NOTHING_FORCED = FastForward((), b"")
FORCED_TEXT_HINT = (
    "a program's forced text must be text the constraint allows: drop the program or the constraint, "
    "or write the pattern to allow that text"
)


def shown_text(data: bytes) -> str:
    """A token's bytes as a user reads them: a special token without the marker byte `vocab_bytes` gives it."""
    if data[:1] == bytes([SPECIAL_TOKEN_MARKER]):
        data = data[1:]
    return data.decode("utf-8", errors="replace")


class Constraint:
    """A row's constraint. `end_token` (e.g. `<|assistant_end|>`'s id) is allowed exactly when the output is complete."""

    def __init__(
        self,
        vocab: ConstraintVocab,
        dfa: ByteDFA,
        end_token: int | None = None,
        *,
        token_healing: bool = True,
        lookback: int = LOOKBACK_TOKENS,
    ) -> None:
        self.vocab = vocab
        self.dfa = dfa
        self.end_token = end_token
        self.token_healing = token_healing
        self.lookback = lookback
        self.state = dfa.start
        self.tokens: list[int] = []
        self._ended = False

    @classmethod
    def regex(
        cls,
        pattern: str,
        vocab: ConstraintVocab,
        end_token: int | None = None,
        special_tokens: Sequence[str] = (),
        **options: Any,
    ) -> Constraint:
        """A constraint from a fully anchored regex; `ConstraintError` if it cannot be compiled.

        Special tokens are unreachable unless named in `special_tokens` and written verbatim at the top level of
        the pattern (`[0-9+*]+<|python_end|>`); `ConstraintError` if one is not a special token of the vocab.
        """
        for name in special_tokens:
            vocab.special_token_id(name)
        return cls(vocab, compile_regex(pattern, tuple(special_tokens)), end_token, **options)

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | str, vocab: ConstraintVocab, end_token: int | None = None, **options: Any
    ) -> Constraint:
        """A constraint from a JSON schema (the subset `json_schema.py` documents); `ConstraintError` otherwise."""
        with metered("the JSON schema"):
            return cls(vocab, compile_regex(schema_to_regex(schema)), end_token, **options)

    # -- state ---------------------------------------------------------------------------------------------------

    def is_accepting(self) -> bool:
        """Whether the output so far is a complete match (the end token may come now)."""
        return self._ended or bool(self.dfa.accepting[self.state])

    def can_extend(self) -> bool:
        """Whether more text is possible (False once the match is complete and maximal, or after the end token)."""
        return not self._ended and self.dfa.can_extend(self.state)

    def is_finished(self) -> bool:
        """True after the end token, or, without an end token, once the match is complete and nothing can follow."""
        if self._ended:
            return True
        return self.end_token is None and self.is_accepting() and not self.can_extend()

    def reset(self) -> None:
        self.state = self.dfa.start
        self.tokens.clear()
        self._ended = False

    # -- masks ---------------------------------------------------------------------------------------------------

    def allowed_mask(self) -> np.ndarray:
        """Packed mask (uint32 words, one bit per token) of the tokens allowed next. Read-only; do not modify.

        While fast-forward tokens exist only the first of them is allowed (as in llguidance), so sampling
        step by step yields exactly the tokens a fast-forwarding engine forces.
        """
        if self._ended:
            return np.zeros((self.vocab.vocab_size + 31) // 32, dtype=np.uint32)
        ff = self._fast_forward()
        if ff.tokens:
            return self.vocab.single_token_mask(ff.tokens[0])
        end = self.end_token if self.end_token is not None and self.dfa.accepting[self.state] else None
        if self.token_healing and ff.healing:
            healed = self.vocab.mask(self.dfa, self.state, ff.healing)
            if healed.any():
                return healed  # forced bytes remain, so the state is not accepting: no end token here
        return self.vocab.mask(self.dfa, self.state, extra_token=end)

    def healing_prefix(self) -> bytes:
        """Bytes the next token must start with (empty when unrestricted); see the module docstring."""
        if not self.token_healing or self._ended:
            return b""
        ff = self._fast_forward()
        return ff.healing if not ff.tokens else b""

    # -- consuming -----------------------------------------------------------------------------------------------

    def consume(self, token: int) -> None:
        """Advance by one token (sampled or forced). `ConstraintError` if the token is not allowed here."""
        if self._ended:
            raise ConstraintError(
                f"token {token} arrived after the end token; the constrained output is finished",
                hint="end the constrained output at its end token",
            )
        # The masks never let the model sample a token refused here: a refused token was forced, by a program
        # (`--program`) whose text the constraint does not allow, and the fix is the user's choice of the two.
        if token == self.end_token:
            if not self.is_accepting():
                raise ConstraintError(
                    f"the reply was ended (by a forced end token) before the output matched {self.dfa.source}",
                    hint=FORCED_TEXT_HINT,
                )
            self._ended = True
            self.tokens.append(token)
            return
        data = self.vocab.token_bytes(token)
        nxt = self.dfa.step(self.state, data) if data else DEAD
        if nxt == DEAD:
            raise ConstraintError(
                f"the forced text {shown_text(data)!r} (token {token}) is not allowed by {self.dfa.source} at this point",
                hint=FORCED_TEXT_HINT,
            )
        self.state = nxt
        self.tokens.append(token)

    def consume_tokens(self, tokens: list[int]) -> None:
        for token in tokens:
            self.consume(token)

    # -- forcing -------------------------------------------------------------------------------------------------

    def forced_bytes(self) -> bytes:
        """The bytes every valid continuation starts with (empty when the next byte is a real choice)."""
        return b"" if self._ended else self.dfa.forced_bytes(self.state)

    def ff_tokens(self) -> list[int]:
        """Tokens that are safe to force now (canonical and not the start of a longer allowed token)."""
        if self._ended:
            return []
        return list(self._fast_forward().tokens)

    def _context(self) -> bytes:
        """Left context for tokenizing forced bytes: the previous token's bytes, extended back over earlier tokens
        while it starts inside a UTF-8 character (so the text decodes); none across special tokens."""
        context = b""
        for token in reversed(self.tokens[-4:]):
            data = self.vocab.token_bytes(token)
            if data[:1] == bytes([SPECIAL_TOKEN_MARKER]):
                break
            context = data + context
            if context[:1] and context[0] & 0xC0 != 0x80:
                break
        return context

    def _fast_forward(self) -> FastForward:
        if self.dfa.accepting[self.state] or self.dfa.live_count[self.state] != 1:
            return _NOTHING_FORCED  # a choice point: nothing forced, nothing cached
        context = self._context()
        key = (self.dfa, self.state, context, self.lookback)
        cache = self.vocab.ff_cache
        found = cache.get(key)
        if found is None:
            found = fast_forward(self.vocab, self.dfa, self.state, context, self.lookback)
            cache[key] = found
            self._seed_along(found)
        return found

    def _seed_along(self, ff: FastForward) -> None:
        """Cache the answers for the states along `ff.tokens`: after its first k tokens the rest are forced.

        Recomputing there would re-tokenize the same forced text with token k as context and reach the same
        cut (the spanning search covers the same final tokens), so one tokenizer call serves the whole run.
        """
        state = self.state
        for k, token in enumerate(ff.tokens):
            data = self.vocab.token_bytes(token)
            state = self.dfa.step(state, data)
            if not data or data[0] & 0xC0 == 0x80 or data[0] == SPECIAL_TOKEN_MARKER:
                return  # that state's context differs (reaches further back, or is empty after a special token)
            self.vocab.ff_cache.setdefault(
                (self.dfa, state, data, self.lookback), FastForward(ff.tokens[k + 1 :], ff.healing)
            )


def batch_bitmask(constraints: Sequence[Constraint | None], vocab_size: int) -> np.ndarray:
    """`uint32[B, ceil(V/32)]` masks for a batch: each constrained row's `allowed_mask()`, all ones for `None` rows.

    Feed it to `apply_token_bitmask(logits, ...)`; tokens past `vocab_size` in the last word stay allowed for
    unconstrained rows (a padded model head is the sampler's business, not the constraint's).
    """
    words = np.full((len(constraints), (vocab_size + 31) // 32), 0xFFFFFFFF, dtype=np.uint32)
    for row, constraint in enumerate(constraints):
        if constraint is not None:
            words[row] = constraint.allowed_mask()
    return words
