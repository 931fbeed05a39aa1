"""Incremental, UTF-8-safe detokenization: one text delta per emitted token, never a broken character.

nanochat's chat CLI decodes every token on its own, so a character split across tokens (an emoji, a CJK
character in a byte-level vocabulary) prints as replacement characters. Here each token maps to its exact bytes
and a per-row incremental UTF-8 decoder holds back an incomplete character until the token that completes it
arrives; the delta is "" meanwhile. Bytes that can never form a character (the model emitted an invalid
sequence) become U+FFFD, which is the honest rendering of what was generated.

Special tokens (the tokenizer's added tokens flagged special, e.g. `<|python_start|>`) are not text: they decode
to their literal name and are flagged so the UI can show a marker. Pending incomplete bytes before a special
token can no longer complete, so they are flushed first.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from functools import lru_cache

from tokenizers import Tokenizer


@lru_cache(maxsize=1)
def _byte_level_decoder_map() -> dict[str, int]:
    """GPT-2's printable-character alphabet for bytes, inverted: character -> byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(tokenizer: Tokenizer) -> set[str]:
    """The decoder types in a tokenizer's pipeline (a Sequence decoder contributes each of its parts)."""
    decoder = tokenizer.decoder  # its own JSON only: the whole tokenizer's is megabytes to parse
    spec = json.loads(decoder.__getstate__()) if decoder is not None else {}
    parts = spec.get("decoders", [spec]) if spec.get("type") == "Sequence" else [spec]
    return {part.get("type", "") for part in parts if isinstance(part, dict)}


class TokenBytes:
    """Exact bytes of every token, and which tokens are special; built lazily, one lookup per distinct token.

    Byte-level BPE (GPT-2, Qwen, chatapp's tokenizers) inverts GPT-2's byte alphabet; SentencePiece-style
    vocabularies map `<0xNN>` to one byte and `▁` to a space; anything else falls back to decoding the token alone.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._special = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        kinds = _decoder_kinds(tokenizer)
        self._to_bytes: Callable[[str], bytes]
        if "ByteLevel" in kinds:
            self._to_bytes = self._from_byte_level
        elif kinds & {"ByteFallback", "Metaspace"}:
            self._to_bytes = self._from_sentencepiece
        else:
            self._to_bytes = self._from_decode
        self._cache: dict[int, bytes] = {}

    def is_special(self, token: int) -> bool:
        return token in self._special

    def special_name(self, token: int) -> str:
        return self._special[token]

    def __call__(self, token: int) -> bytes:
        """The bytes token `token` stands for (a special token's name for special tokens)."""
        cached = self._cache.get(token)
        if cached is None:
            if token in self._added:
                cached = self._added[token].encode()
            else:
                piece = self._tokenizer.id_to_token(token)
                cached = b"" if piece is None else self._to_bytes(piece)
            self._cache[token] = cached
        return cached

    @staticmethod
    def _from_byte_level(piece: str) -> bytes:
        table = _byte_level_decoder_map()
        return bytes(table[c] for c in piece if c in table)

    @staticmethod
    def _from_sentencepiece(piece: str) -> bytes:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("▁", " ").encode()

    def _from_decode(self, piece: str) -> bytes:
        token = self._tokenizer.token_to_id(piece)
        return self._tokenizer.decode([token], skip_special_tokens=False).encode() if token is not None else b""


class Detokenizer:
    """One row's incremental detokenizer: `push(token)` returns the text that became complete with it."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._bytes = token_bytes
        self.token_bytes = token_bytes  # the vocabulary's bytes, for alternatives' pieces
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> tuple[str, bool]:
        """(text delta, is_special) for the next token of the row."""
        if self._bytes.is_special(token):
            return self.flush() + self._bytes.special_name(token), True
        return self._decoder.decode(self._bytes(token)), False

    def flush(self) -> str:
        """Whatever incomplete bytes are pending, rendered now (as U+FFFD): the row ended or a special token came."""
        return self._decoder.decode(b"", final=True)
