"""The message schema: a conversation as a list of `{"role", "content"}` dicts, validated into `Turn`s.

User and system content is a string; assistant content is a string or a list of parts `{"type": "text" | "python" |
"python_output", "text": str}` (a tool call and its result, as nanochat writes them). Also the helpers both chat
formats share: dropping a trailing assistant message, and the private tokenizer that encodes structural special
tokens as text.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tokenizers import Tokenizer

from chatapp.errors import ConversationError
from chatapp.tools.parts import PART_TYPES, PartType

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True, slots=True)
class Part:
    """One piece of a message's content."""

    type: PartType
    text: str


@dataclass(frozen=True, slots=True)
class Turn:
    """A validated message: its role and content parts (a plain string becomes one text part)."""

    role: Role
    parts: tuple[Part, ...]

    @property
    def text(self) -> str:
        """The content as one string (meaningful for text-only content)."""
        return "".join(part.text for part in self.parts)


def parse_messages(messages: Sequence[Mapping[str, Any]]) -> list[Turn]:
    """Validate a conversation and return its turns.

    The shape nanochat trains on: an optional system message first, then user and assistant messages alternating,
    starting with a user. Errors name the message at fault so a bad JSONL line or history entry is easy to fix.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ConversationError(
            f"a conversation must be a list of messages, got {type(messages).__name__}",
            hint='give a list of {"role": ..., "content": ...} messages',
        )
    turns: list[Turn] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ConversationError(
                f"message {index} must be a dict with 'role' and 'content', got {message!r:.80}",
                hint='give each message as {"role": ..., "content": ...}',
            )
        role = message.get("role")
        if role not in ("system", "user", "assistant"):
            raise ConversationError(f"message {index} has role {role!r}", hint="use 'system', 'user' or 'assistant'")
        expected = _expected_role(index, has_system=bool(turns) and turns[0].role == "system")
        if role not in expected:
            raise ConversationError(
                f"message {index} is from {role!r} but should be from {' or '.join(repr(r) for r in expected)}",
                hint="start with an optional system message, then alternate user and assistant messages",
            )
        turns.append(Turn(role, _parse_content(index, role, message.get("content"))))
    return turns


def _expected_role(index: int, *, has_system: bool) -> tuple[str, ...]:
    if index == 0:
        return ("system", "user")
    position = index - 1 if has_system else index
    return ("user",) if position % 2 == 0 else ("assistant",)


def _parse_content(index: int, role: str, content: object) -> tuple[Part, ...]:
    if isinstance(content, str):
        return (Part("text", content),)
    if role != "assistant" or not isinstance(content, list):
        allowed = "a string or a list of parts" if role == "assistant" else "a string"
        raise ConversationError(
            f"message {index} ({role}) content must be {allowed}, got {type(content).__name__}",
            hint="give the content as text",
        )
    parts = []
    for part_index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        text = part.get("text") if isinstance(part, Mapping) else None
        if kind not in PART_TYPES or not isinstance(text, str):
            raise ConversationError(
                f"message {index} part {part_index} must be {{'type': one of {', '.join(PART_TYPES)}, "
                f"'text': str}}, got {part!r:.80}", hint="give each part as {\"type\": \"text\", \"text\": ...}"
            )
        parts.append(Part(kind, text))
    return tuple(parts)


def _drop_trailing_assistant(turns: list[Turn]) -> list[Turn]:
    if turns and turns[-1].role == "assistant":
        turns = turns[:-1]
    if not turns or turns[-1].role != "user":
        raise ConversationError(
            "a conversation to complete must contain a user message", hint="end the conversation with a user message"
        )
    return turns


def _text_tokenizer(tokenizer: Tokenizer, structural: Collection[str] | None) -> Tokenizer:
    """A private copy of `tokenizer` that encodes structural special tokens as ordinary text.

    `encode_special_tokens = True` makes the Rust tokenizer skip matching *special* added tokens; non-special added
    tokens (content markers such as `<think>`) still match. With `structural` given, exactly those tokens are marked
    special in the copy and every other added token becomes content vocabulary; with None the tokenizer's own
    special flags decide (Qwen marks its chat tokens special and `<tool_call>`-like markers not).
    The copy is never mutated after this, so it may be shared by threads.
    """
    if structural is None:  # the flags stay: a copy made in Rust (a JSON round trip in Python costs 0.3 s)
        clone = Tokenizer.from_str(tokenizer.to_str())
    else:
        spec = json.loads(tokenizer.to_str())
        for token in spec.get("added_tokens", []):
            token["special"] = token["content"] in structural
        clone = Tokenizer.from_str(json.dumps(spec))
    clone.encode_special_tokens = True
    return clone


class TokenizerText:
    """What every chat format does with its tokenizer's text: encode a content as text, its special-token names
    staying ordinary characters (`_text_tokenizer`; `structural` as there), and decode ids with special tokens
    written as their names."""

    def __init__(self, tokenizer: Tokenizer, structural: Collection[str] | None) -> None:
        self.tokenizer = tokenizer
        self._structural = structural
        # The names the private copy leaves as text. A content that holds none of them (nearly every one) encodes
        # the same through the shared tokenizer, so the copy is made only for the first that does: making it costs
        # 0.2-0.3 s and ~30 MB for a 49k vocabulary, at every start of every command.
        added = tokenizer.get_added_tokens_decoder().values()
        self._guarded = tuple(
            t.content for t in added if (t.special if structural is None else t.content in structural)
        )
        self._normalizer = tokenizer.normalizer  # added tokens may match the normalized text as well
        self._encoder: Tokenizer | None = None
        self._lock = threading.Lock()

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` as content: structural special-token names in it stay ordinary characters."""
        probe = text if self._normalizer is None else f"{text}\0{self._normalizer.normalize_str(text)}"
        if not any(name in probe for name in self._guarded):
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self._text_encoder().encode(text, add_special_tokens=False).ids

    def _text_encoder(self) -> Tokenizer:
        with self._lock:
            if self._encoder is None:
                self._encoder = _text_tokenizer(self.tokenizer, self._structural)
            return self._encoder

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens written as their names."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)
