"""What the compiler needs to know about a tokenizer: each token's text, which tokens are special, and encoding."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property

from tokenizers import Tokenizer


class TokenVocab:
    """Token texts of a `tokenizers.Tokenizer`, for resolving token names and `contains` sets.

    `aliases` maps a token name a program may use to this tokenizer's token for it: built-in programs are written
    with nanochat's names (`<|python_start|>`, `<|assistant_end|>`), and a chat format whose tool markers and turn end
    are other tokens (SmolLM2: `<jupyter_code>`, `<|im_end|>`) supplies the map, so one program runs on both.
    """

    def __init__(self, tokenizer: Tokenizer, aliases: Mapping[str, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.aliases = dict(aliases or {})
        self.size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special)

    @cached_property
    def texts(self) -> tuple[str, ...]:
        """The text of every token id (a token holding part of a UTF-8 character shows U+FFFD)."""
        return tuple(self.tokenizer.decode_batch([[i] for i in range(self.size)], skip_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization; special-token names in `text` (aliases applied) become their special tokens."""
        for name, token in self.aliases.items():
            text = text.replace(name, token)
        # `encode_batch` releases the interpreter lock while it works (`encode` holds it): a program compiling in a
        # worker thread must not freeze the UI thread for the length of a long forced text's tokenization.
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def token(self, name: str) -> int | None:
        """The one token whose text is `name`: a special/added token by name, else the ordinary token."""
        name = self.aliases.get(name, name)
        if (special := self.tokenizer.token_to_id(name)) is not None and special in self.special_ids:
            return special
        ids = self.encode(name)
        if len(ids) == 1 and self.texts[ids[0]] == name:
            return ids[0]
        # Not the canonical tokenization of `name`, but a token with that text may still exist.
        matches = [i for i, text in enumerate(self.texts) if text == name and i not in self.special_ids]
        return matches[0] if matches else None

    def containing(self, needle: str) -> list[int]:
        """Ordinary tokens whose text contains `needle` (special tokens only match by name)."""
        return [i for i, text in enumerate(self.texts) if needle in text and i not in self.special_ids]

    def show(self, token: int) -> str:
        """A token as the disassembler prints it: its text, quoted with escapes."""
        return _quote(self.texts[token])


def _quote(text: str) -> str:
    return '"' + text.encode("unicode_escape").decode("ascii").replace('"', '\\"') + '"'
