"""Tokenizers for the trie tests, all trained locally (no hub): a 32k byte-level BPE on the standard library's
sources, a SentencePiece-style byte-fallback BPE, and the seed's hand-made vocabulary."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.trie.local_tokenizers import (
    cached_source_tokenizer,
    handmade_bpe,
    python_source_texts,
    train_byte_fallback_tokenizer,
)

UNICODE_SAMPLES = [
    "naïve café — déjà vu, 漢字かな交じり文, Ünïcödé «quotes» ½ €5 😀 ok",
    "Grüße aus Köln! Ελληνικά, русский текст, עברית, 한국어.",
]

SEED_TOKENS = [
    "or",
    "order",
    "orderId",
    "Id",
    "Name",
    "name",
    "_of",
    "_the",
    "_person",
    '":',
    '": ',
    '{"',
    "age",
]
"""The vocabulary of the fast-forward examples (`docs/trie.md`): `orderName` is deliberately not a token."""

END_TOKEN = "<|end|>"


@pytest.fixture(scope="session")
def source_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """32k byte-level BPE on ~11 MB of standard-library sources (seconds to train; once per session)."""
    return cached_source_tokenizer(tmp_path_factory.mktemp("tokenizers"), vocab_size=32_000)


@pytest.fixture(scope="session")
def byte_fallback_tokenizer() -> Tokenizer:
    """Metaspace BPE with `<0xNN>` byte-fallback tokens in its vocabulary and the chat special tokens."""
    texts = [*python_source_texts(300_000), *UNICODE_SAMPLES * 3]
    return train_byte_fallback_tokenizer(texts, vocab_size=1500, special_tokens=["<|bos|>", "<|assistant_end|>"])


@pytest.fixture(scope="session")
def seed_tokenizer() -> Tokenizer:
    return handmade_bpe(SEED_TOKENS, special_tokens=[END_TOKEN])
