"""The byte string of every token of a `tokenizers.Tokenizer`.

Constraints work on bytes, not on token strings: a token's *string* in `tokenizer.json` is an encoding artefact
(GPT-2 maps bytes to printable characters, SentencePiece writes spaces as `▁` and raw bytes as `<0xNN>`). Decoding
each token separately with the tokenizer's decoder is not an option either: decoders strip leading spaces and merge
byte-fallback pieces only across neighbouring tokens, so a single token does not decode to its own bytes.

Special tokens (`<|assistant_end|>` …) get the bytes `0xFF` + name, as in llguidance: `0xFF` never occurs in UTF-8,
so no text constraint can reach them, and a constraint that wants one names those exact bytes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from tokenizers import Tokenizer

from chatapp.byte_level import byte_for_char

SPECIAL_TOKEN_MARKER = 0xFF
"""First byte of every special token's byte string; invalid in UTF-8, so regexes over text never match it."""

_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_METASPACE = "▁"


def gpt2_unicode_to_byte() -> dict[str, int]:
    """Invert GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the rest to code points from 256 up."""
    return byte_for_char()


@dataclass(frozen=True)
class VocabBytes:
    """Per-token bytes for ids `0..vocab_size-1` (ids the tokenizer does not define have empty bytes: never allowed)."""

    tokens: list[bytes]
    special_ids: frozenset[int]

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def special_bytes(self, name: str) -> bytes:
        """The bytes a constraint uses to name special token `name` (e.g. to allow `<|python_end|>` in a grammar)."""
        return bytes([SPECIAL_TOKEN_MARKER]) + name.encode()


def _mentions(node: Any, type_name: str) -> bool:
    """Whether a (possibly nested `Sequence`) normalizer / pre-tokenizer / decoder config contains `type_name`."""
    if isinstance(node, dict):
        if node.get("type") == type_name:
            return True
        return any(_mentions(v, type_name) for v in node.values())
    if isinstance(node, list):
        return any(_mentions(v, type_name) for v in node)
    return False


@cache
def _byte_level_translation() -> dict[int, str]:
    """`str.translate` table taking each byte-level character to the latin-1 character of its byte."""
    return {ord(ch): chr(b) for ch, b in gpt2_unicode_to_byte().items()}


def _byte_level_bytes(piece: str) -> bytes | None:
    """Bytes of a GPT-2 byte-level token string, or None if a character is outside the byte alphabet."""
    mapped = piece.translate(_byte_level_translation())
    try:
        return mapped.encode("latin-1")
    except UnicodeEncodeError:
        return None


def _component_config(component: Any) -> Any:
    """The JSON config of a tokenizer component (pre-tokenizer, decoder), or None when it is not set."""
    return None if component is None else json.loads(component.__getstate__())


def _sentencepiece_bytes(piece: str, byte_fallback: bool) -> bytes:
    """Bytes of a SentencePiece-style token: `<0xNN>` is one raw byte, `▁` is a space, the rest is UTF-8."""
    if byte_fallback and (m := _BYTE_FALLBACK_TOKEN.fullmatch(piece)):
        return bytes([int(m.group(1), 16)])
    return piece.replace(_METASPACE, " ").encode()


def vocab_bytes(tokenizer: Tokenizer, vocab_size: int | None = None) -> VocabBytes:
    """Bytes of every token id of `tokenizer`, padded with empty entries up to `vocab_size` (a model's larger head).

    The scheme follows the tokenizer's own configuration: a `ByteLevel` pre-tokenizer or decoder means GPT-2
    byte-level strings; otherwise tokens are SentencePiece-like (`▁` for space, `<0xNN>` byte fallback when the BPE
    model has `byte_fallback`). Added tokens are literal text (never byte-mapped); special ones get `0xFF` + name.
    """
    pre_tokenizer = _component_config(tokenizer.pre_tokenizer)
    decoder = _component_config(tokenizer.decoder)
    byte_level = _mentions(pre_tokenizer, "ByteLevel") or _mentions(decoder, "ByteLevel")
    byte_fallback = bool(getattr(tokenizer.model, "byte_fallback", False))
    added = tokenizer.get_added_tokens_decoder()
    n = max(tokenizer.get_vocab_size(with_added_tokens=True), vocab_size or 0)
    tokens: list[bytes] = [b""] * n
    special: set[int] = set()
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        piece = tokenizer.id_to_token(token_id)
        if piece is None:
            continue
        if token_id in added:
            if added[token_id].special and not (byte_fallback and _BYTE_FALLBACK_TOKEN.fullmatch(piece)):
                tokens[token_id] = bytes([SPECIAL_TOKEN_MARKER]) + piece.encode()
                special.add(token_id)
                continue
            if not byte_fallback or not _BYTE_FALLBACK_TOKEN.fullmatch(piece):
                tokens[token_id] = piece.encode()
                continue
        if byte_level:
            as_bytes = _byte_level_bytes(piece)
            tokens[token_id] = as_bytes if as_bytes is not None else piece.encode()
        else:
            tokens[token_id] = _sentencepiece_bytes(piece, byte_fallback)
    return VocabBytes(tokens=tokens, special_ids=frozenset(special))
