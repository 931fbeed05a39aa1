"""Shared by the benchmark scripts (not a benchmark itself: `make bench` skips files starting with `_`)."""

from __future__ import annotations

from collections.abc import Sequence


class NoStopFormat:
    """A chat format without stop tokens, so every side generates exactly the tokens asked for. Benchmarks pass
    token ids, so the engine never asks it to render a conversation."""

    supports_tools = False
    assistant_end_id = None
    stop_token_ids: tuple[int, ...] = ()
    program_aliases: dict[str, str] = {}

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))
