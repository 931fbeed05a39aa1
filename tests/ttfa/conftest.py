"""A tokenizer like the default model's: the chat specials plus <think> and </think>, trained on its formats."""

from __future__ import annotations

import pytest

THINK_TOKENS = ("<think>", "</think>")

FORMAT_TEXTS = (
    '{"topic": "geography", "answer": "Paris is the capital of France."}',
    '{"topic": "math", "answer": "37*45 is 1665."}',
    '{"topic": "words", "answer": "The word strawberry has 3 r letters."}',
    "<think>The user asks for a sum. 2 plus 2 is 4.</think>The answer is 4.",
    "<think>Let me think about the letters one by one.</think>There are 3 r letters.",
    "Let me compute that. 37*45 is 1665. The quick brown fox jumps over the lazy dog.\n\nNew paragraph.\n",
    'She said "hello." Then "goodbye?" and "ok!"\n',
    "A list:\n\n\n- one\n\n\n- two\n",  # runs of newlines, so BPE learns merged newline tokens
)


@pytest.fixture(scope="session")
def ttfa_tokenizer():
    """Deterministic: the same corpus always trains the same merges, so disassembly goldens are stable."""
    from chatapp.recipes.tiny.tokenizer import CHAT_SPECIAL_TOKENS, train_bpe_tokenizer

    return train_bpe_tokenizer(
        list(FORMAT_TEXTS) * 20, vocab_size=400, special_tokens=CHAT_SPECIAL_TOKENS + THINK_TOKENS
    )
