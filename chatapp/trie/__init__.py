"""Token trie, grammar constraints and fast-forward tokens (`docs/trie.md`).

Engine-facing API
-----------------
Build one `ConstraintVocab` per tokenizer and model (token bytes, trie, vocabulary slices, mask cache; about
0.3 s for 32k tokens, 1.2 s for 128k on a 2-core box) and one `Constraint` per constrained row::

    from chatapp.trie import Constraint, ConstraintVocab, apply_token_bitmask, batch_bitmask

    vocab = ConstraintVocab.from_tokenizer(tokenizer, vocab_size=model.config.vocab_size)
    end = vocab.token_id("<|assistant_end|>")
    row = Constraint.regex(r"[0-9]+", vocab, end_token=end)          # or:
    row = Constraint.json_schema({"type": "object", ...}, vocab, end_token=end)

Bad regexes and schemas outside the supported subset raise `chatapp.errors.ConstraintError` naming the input.
Special tokens never match text; a regex may name some (`special_tokens=["<|python_end|>"]`, written verbatim at
the pattern's top level: `[0-9+*]+<|python_end|>`), and fast-forward then forces them like any other token.

Each decode step (rows without a constraint pass None)::

    words = batch_bitmask(row_constraints, vocab.vocab_size)  # uint32[B, W] on the host; None rows: all ones
    apply_token_bitmask(logits, words)  # -inf where disallowed, in place, on the logits' device
    ... sample ...
    for c, token in zip(row_constraints, sampled):   # host ints (from the step's one device-to-host copy)
        if c is not None:
            c.consume(token)                          # ConstraintError if the token was not allowed

`apply_token_bitmask(logits[B, V], bitmask[B, W])` works in place (also returns logits), accepts numpy or a
tensor on any device, is one broadcast op (no loop over rows, no sync beyond the host-to-device copy of the
words) and masks out ids past `32 * W` (a padded model head). Keep the bitmask on device if it is reused.

After consuming, fast-forward::

    ff = c.ff_tokens()              # tokens safe to force now (canonical; may be [])
    # push ff through the model in one multi-token forward (forced=True), then
    c.consume_tokens(ff)

While `ff_tokens()` is non-empty, `allowed_mask()` allows only its first token, so a step-by-step engine emits the
same tokens as a fast-forwarding one. `forced_bytes()` is the raw forced text; `healing_prefix()` the bytes the
next sampled token must start with (token healing, already applied to the mask). `is_accepting()`: the end token
is allowed now; `is_finished()`: the end token was consumed (or, with `end_token=None`, nothing more can come);
`can_extend()`: more text is possible. The end token is in the mask exactly when the output is complete.
Masks are cached per (DFA, state, healing prefix) in the vocab, so rows in the same state share one trie walk.

Lower level: `compile_regex(rx) -> ByteDFA`, `schema_to_regex(schema)`, `TokTrie.build(token_bytes)`,
`TokTrie.walk(recognizer)` (Python, any `Recognizer` with `try_push_byte`/`pop_bytes`), `CompiledWalker.mask`
(numba, DFAs), `vocab_bytes(tokenizer)`.
"""

from chatapp.trie.bitmask import allowed_ids, apply_token_bitmask, bitmask_from_bools, bitmask_to_bools
from chatapp.trie.constraint import Constraint, batch_bitmask
from chatapp.trie.dfa import ByteDFA
from chatapp.trie.json_schema import schema_to_regex
from chatapp.trie.regex import compile_regex
from chatapp.trie.token_bytes import SPECIAL_TOKEN_MARKER, VocabBytes, vocab_bytes
from chatapp.trie.toktrie import Recognizer, TokTrie
from chatapp.trie.vocab import ConstraintVocab
from chatapp.trie.walk import CompiledWalker

__all__ = [
    "SPECIAL_TOKEN_MARKER",
    "ByteDFA",
    "CompiledWalker",
    "Constraint",
    "ConstraintVocab",
    "Recognizer",
    "TokTrie",
    "VocabBytes",
    "allowed_ids",
    "apply_token_bitmask",
    "batch_bitmask",
    "bitmask_from_bools",
    "bitmask_to_bools",
    "compile_regex",
    "schema_to_regex",
    "vocab_bytes",
]
