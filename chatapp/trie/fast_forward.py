"""Fast-forward tokens: forced bytes turned into tokens the model would have produced itself (`docs/trie.md`).

Forcing the naive tokenization of forced bytes is often non-canonical: with `orderId` in the vocabulary, forcing
`order` leaves the model a split it never saw in training. So, as llguidance does:

1. tokenize the forced bytes canonically (with the previous token's bytes as left context, then cut at the
   boundary, so merges across the boundary do not leak into the forced tokens);
2. look at the last `lookback` tokens' bytes; find the first position whose suffix is the proper prefix of a
   longer vocabulary token that the grammar allows there (that token would span the end of the forced bytes);
3. drop every final token that reaches past that position. The dropped bytes are still forced; the constraint
   requires the next sampled token to start with them (token healing, see `Constraint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from chatapp.trie.dfa import ByteDFA
from chatapp.trie.token_bytes import SPECIAL_TOKEN_MARKER
from chatapp.trie.vocab import ConstraintVocab

LOOKBACK_TOKENS = 4
"""How many final tokens may be dropped; llguidance found >= 2 enough for zero non-canonical cases on MaskBench."""


@dataclass(frozen=True)
class FastForward:
    """Tokens safe to force now, and the forced bytes left for the next sampled token to start with."""

    tokens: tuple[int, ...]
    healing: bytes


def tokenize_forced(vocab: ConstraintVocab, forced: bytes, context: bytes = b"") -> list[int] | None:
    """Canonical tokens covering `forced` (all of it, or all but an incomplete final character), tokenized after
    `context`; None if there is no clean cut.

    The text `context + forced` is tokenized and cut where the context ends. If a token straddles that point
    the context merged into the forced bytes: retry without context. Context also lets forced bytes that start
    inside a character (the previous token ended mid-character) be tokenized. Text that is not valid UTF-8, or
    whose tokens do not end with exactly the forced bytes (a tokenizer that prepends a space, a special-token
    name inside the text), gives None: forcing nothing is always safe.
    """
    for prefix in (context, b"") if context else (b"",):
        whole = _without_incomplete_tail(prefix + forced)
        if len(whole) <= len(prefix):
            continue
        try:
            text = whole.decode("utf-8")
        except UnicodeDecodeError:
            continue
        target = whole[len(prefix) :]
        ids = vocab.encode(text)
        ends = _token_ends(vocab, ids)
        start = ends[-1] - len(target) if ends else -1
        if start < 0 or b"".join(vocab.token_bytes(t) for t in ids)[start:] != target:
            continue
        cut = [k for k, end in enumerate(ends) if end == start] if start else [-1]
        if cut:
            return ids[cut[0] + 1 :]
    return None


def _through_special_token(
    vocab: ConstraintVocab, dfa: ByteDFA, state: int, forced: bytes, marker: int, context: bytes, lookback: int
) -> FastForward:
    """Forced bytes that reach a special token (0xFF + name): the text before it, the token, then what follows.

    Tokenizers split text at special tokens, so the text before one is tokenized on its own and no token can
    span into the special token: all of that text is forced, with no tokens dropped.
    """
    text, rest = forced[:marker], forced[marker:]
    tokens: tuple[int, ...] = ()
    if text:
        found = tokenize_forced(vocab, text, context)
        if not found or sum(len(vocab.token_bytes(t)) for t in found) != len(text):
            return FastForward((), forced)
        tokens = tuple(found)
    special = vocab.special_prefix(rest)
    if special is None:
        return FastForward(tokens, rest)
    after = dfa.step(state, text + vocab.token_bytes(special))
    following = fast_forward(vocab, dfa, after, b"", lookback)
    return FastForward((*tokens, special, *following.tokens), following.healing)


def _without_incomplete_tail(data: bytes) -> bytes:
    """`data` minus a final UTF-8 character that is cut short (forced bytes may stop inside a character)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead (or ASCII) byte: is its character complete?
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return data if need <= back else data[:-back]
    return data


def _token_ends(vocab: ConstraintVocab, ids: list[int]) -> list[int]:
    """Cumulative byte offsets where each token ends."""
    table = vocab.bytes.tokens
    return list(accumulate(len(table[t]) for t in ids))


def _spanned_by_longer_token(vocab: ConstraintVocab, dfa: ByteDFA, state_after: int, forced: bytes, idx: int) -> bool:
    """Whether a token strictly longer than `forced[idx:]` starts with it and the grammar allows it at `idx`.

    `state_after` is the DFA state after all of `forced` (the same whichever `idx` the suffix starts at).
    """
    node = vocab.trie.node_for(forced[idx:])
    return node is not None and vocab.walker.any_token_below(dfa, state_after, node)


def fast_forward(
    vocab: ConstraintVocab,
    dfa: ByteDFA,
    state: int,
    context: bytes = b"",
    lookback: int = LOOKBACK_TOKENS,
) -> FastForward:
    """The seed's algorithm for the bytes `dfa` forces from `state` (see module docstring)."""
    forced, after = dfa.forced_run(state)
    if not forced:
        return FastForward((), b"")
    marker = forced.find(SPECIAL_TOKEN_MARKER)
    if marker >= 0:
        return _through_special_token(vocab, dfa, state, forced, marker, context, lookback)
    tokens = tokenize_forced(vocab, forced, context)
    if not tokens:
        return FastForward((), forced)
    ends = _token_ends(vocab, tokens)
    covered = ends[-1]
    tail_start = ends[-lookback - 1] if len(tokens) > lookback else 0
    # Bytes past `covered` (an incomplete final character) are never forced as tokens: they always stay behind.
    idx = next(
        (i for i in range(tail_start, covered) if _spanned_by_longer_token(vocab, dfa, after, forced, i)), covered
    )
    keep = len(tokens)
    while keep and ends[keep - 1] > idx:
        keep -= 1
    kept_bytes = ends[keep - 1] if keep else 0
    return FastForward(tuple(tokens[:keep]), forced[kept_bytes:])
