"""nanochat's chat format: `<|bos|>`, then `<|user_start|>`text`<|user_end|>` and `<|assistant_start|>`...
`<|assistant_end|>` per turn, tool calls as `<|python_start|>`expr`<|python_end|>` and results as
`<|output_start|>`value`<|output_end|>`. Used when the tokenizer carries those 9 special tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from chatapp.chat.messages import Part, TokenizerText, Turn, _drop_trailing_assistant, parse_messages
from chatapp.errors import ConversationError, ModelDirError
from chatapp.special_tokens import CHAT_TOKENS
from chatapp.tools.base import NANOCHAT_TOOL_MARKERS, ToolMarkers


class _Builder:
    """Accumulates ids with their loss-mask value (1 = the model is trained to produce this token)."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []

    def add(self, ids: Iterable[int], supervised: bool) -> None:
        ids = list(ids)
        self.ids.extend(ids)
        self.mask.extend([int(supervised)] * len(ids))


class ChatFormat(TokenizerText):
    """nanochat's chat format over a tokenizer with the 9 chat special tokens.

    Loss mask: assistant text, the python call (with its markers) and `<|assistant_end|>` are supervised; BOS, user
    turns, `<|assistant_start|>` and tool output (`<|output_start|>`..`<|output_end|>`, produced by the calculator at
    run time) are not. Any added token other than the 9 (e.g. `<think>`) is content vocabulary: it encodes to its
    single id wherever it appears in text.
    """

    supports_tools = True
    # Built-in TTFA programs are written with this format's own token names: nothing to translate.
    program_aliases: dict[str, str] = {}
    tool_markers: ToolMarkers | None = NANOCHAT_TOOL_MARKERS

    bos_id: int
    user_start_id: int
    user_end_id: int
    assistant_start_id: int
    assistant_end_id: int
    python_start_id: int
    python_end_id: int
    output_start_id: int
    output_end_id: int

    def __init__(self, tokenizer: Tokenizer) -> None:
        missing = [name for name in CHAT_TOKENS.values() if tokenizer.token_to_id(name) is None]
        if missing:
            raise ModelDirError(
                f"the tokenizer lacks the chat special tokens {', '.join(missing)}",
                hint="use chat_format_for(tokenizer, model_dir), which falls back to the checkpoint's chat template",
            )
        super().__init__(tokenizer, structural=set(CHAT_TOKENS.values()))
        for attribute, name in CHAT_TOKENS.items():
            setattr(self, attribute, tokenizer.token_to_id(name))
        # The row ends when the model emits either; nanochat also stops on a stray <|bos|>.
        self.stop_token_ids: tuple[int, ...] = (self.assistant_end_id, self.bos_id)

    def render_conversation(
        self, messages: Sequence[Mapping[str, Any]], max_tokens: int | None = None
    ) -> tuple[list[int], list[int]]:
        """Ids and loss mask (0/1 per id) of a whole conversation, truncated to `max_tokens` if given."""
        out = _Builder()
        out.add([self.bos_id], False)
        for turn in _merge_system(parse_messages(messages)):
            if turn.role == "user":
                out.add([self.user_start_id], False)
                out.add(self.encode_text(turn.text), False)
                out.add([self.user_end_id], False)
            else:
                self._render_assistant(turn, out)
        if max_tokens is not None:
            return out.ids[:max_tokens], out.mask[:max_tokens]
        return out.ids, out.mask

    def _render_assistant(self, turn: Turn, out: _Builder) -> None:
        out.add([self.assistant_start_id], False)
        for part in turn.parts:
            ids = self.encode_text(part.text)
            if part.type == "text":
                out.add(ids, True)
            elif part.type == "python":
                out.add([self.python_start_id, *ids, self.python_end_id], True)
            else:  # python_output: written by the calculator at run time, never by the model
                out.add([self.output_start_id, *ids, self.output_end_id], False)
        out.add([self.assistant_end_id], True)

    def render_for_completion(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Prompt ids for the next assistant answer: the conversation (minus a trailing assistant message) then
        `<|assistant_start|>`."""
        turns = _drop_trailing_assistant(parse_messages(messages))
        ids, _ = self.render_conversation([_as_message(turn) for turn in turns])
        return [*ids, self.assistant_start_id]


def _as_message(turn: Turn) -> dict[str, Any]:
    if turn.role != "assistant":
        return {"role": turn.role, "content": turn.text}
    return {"role": "assistant", "content": [{"type": part.type, "text": part.text} for part in turn.parts]}


def _merge_system(turns: list[Turn]) -> list[Turn]:
    """nanochat has no system turn: a system message is prepended to the first user message, joined by a blank line."""
    if not turns or turns[0].role != "system":
        return turns
    if len(turns) == 1:
        raise ConversationError(
            "a system message must be followed by a user message", hint="add a user message after the system message"
        )
    system, user, *rest = turns
    return [Turn("user", (Part("text", f"{system.text}\n\n{user.text}"),)), *rest]
