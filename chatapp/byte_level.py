"""GPT-2's byte-level alphabet: how byte-level BPE vocabularies (GPT-2, SmolLM, Llama 3, Qwen2) spell raw bytes as
printable characters in their token strings. Read by the GGUF tokenizer builder (`models.gguf_tokenizer`), which
spells tokens in it, and the token trie (`trie.token_bytes`), which reads tokens' bytes back out of it. A module of
its own so that neither imports the other's package (the trie's loads numba and torch)."""

from __future__ import annotations

from functools import cache


@cache
def char_for_byte() -> dict[int, str]:
    """Printable Latin-1 bytes stand for themselves; the other 68 map to U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + extra)
            extra += 1
    return spelling


@cache
def byte_for_char() -> dict[str, int]:
    """The inverse of `char_for_byte`."""
    return {ch: b for b, ch in char_for_byte().items()}
