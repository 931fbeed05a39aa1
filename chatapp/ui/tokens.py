"""Pure helpers that turn a stream of `TokenEvent`s into what the transcript shows and what the history stores.

Nothing here knows about Textual: the transcript, the exporter and the history store all share these functions,
so a resumed conversation renders exactly like the live one did.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from chatapp.engine.events import TokenEvent, ToolEvent
from chatapp.engine.reply import Reply
from chatapp.tools.base import NANOCHAT_TOOL_MARKERS, ToolMarkers

# Chat-format special tokens get short readable names; any other special token keeps its own name.
_MARKER_NAMES = {
    "python_start": "python",
    "python_end": "/python",
    "output_start": "output",
    "output_end": "/output",
    "assistant_start": "assistant",
    "assistant_end": "end",
    "user_start": "user",
    "user_end": "/user",
    "bos": "bos",
    # ChatML (SmolLM2, Qwen) turn markers, and SmolLM2's tool markers (the default model's tool protocol).
    "im_start": "start",
    "im_end": "end",
    "jupyter_code": "python",
    "jupyter_output": "output",
    "jupyter_text": "/output",
}


def marker(special_text: str) -> str:
    """The readable marker shown for a special token, e.g. `<|python_start|>` -> `⟨python⟩`, `<think>` -> `⟨think⟩`."""
    name = special_text
    if name.startswith("<|") and name.endswith("|>"):
        name = name[2:-2]
    elif name.startswith("<") and name.endswith(">"):
        name = name[1:-1]
    return f"⟨{_MARKER_NAMES.get(name, name)}⟩"


def display_text(event: TokenEvent) -> str:
    """What the transcript shows for one token: its text, or a marker for a special token."""
    return marker(event.text) if event.special else event.text


@dataclass
class Segment:
    """A run of an assistant message's tokens shown as one block: plain text, or one tool call."""

    kind: Literal["text", "tool"]
    start: int
    end: int
    call: ToolEvent | None = None
    outcome: ToolEvent | None = None  # the result or refusal, once it arrived
    closed: bool = False  # a tool segment closes with its `<|output_end|>`; text after it starts a new segment


@dataclass
class Segmenter:
    """Splits an assistant message's token stream into text and tool-call segments, incrementally.

    A tool segment runs from the call's start marker to the output's end marker inclusive (`<|python_start|>` ...
    `<|output_end|>` for nanochat's format), so the expression, the forced result and their markers live inside the
    collapsible block while the prose around it stays in the text.
    """

    markers: ToolMarkers = NANOCHAT_TOOL_MARKERS
    segments: list[Segment] = field(default_factory=list)
    _count: int = 0

    def feed(self, events: Iterable[TokenEvent]) -> list[Segment]:
        """Add events; return the segments that changed or were created (in order)."""
        touched: list[Segment] = []
        for event in events:
            index = self._count
            self._count += 1
            current = self.segments[-1] if self.segments else None
            if event.special and event.text == self.markers.call_start:
                current = Segment("tool", index, index)
                self.segments.append(current)
            elif current is None or current.closed:
                current = Segment("text", index, index)
                self.segments.append(current)
            current.end = index + 1
            if event.tool is not None:
                if event.tool.kind == "call":
                    current.call = event.tool
                else:
                    current.outcome = event.tool
            if event.special and event.text == self.markers.output_end:
                current.closed = True
            if not touched or touched[-1] is not current:
                touched.append(current)
        return touched


def segment_events(events: Sequence[TokenEvent], markers: ToolMarkers = NANOCHAT_TOOL_MARKERS) -> list[Segment]:
    """All segments of a finished message."""
    segmenter = Segmenter(markers)
    segmenter.feed(events)
    return segmenter.segments


def message_content(
    events: Sequence[TokenEvent], markers: ToolMarkers = NANOCHAT_TOOL_MARKERS
) -> str | list[dict[str, str]]:
    """The chat-format content of an assistant answer rebuilt from its tokens by the engine's reply fold. Used to
    store partial answers and to resume a conversation, so it must not depend on the backend's own bookkeeping."""
    reply = Reply(markers=markers)
    for event in events:
        reply.add(event)
    return reply.content


def plain_text(content: str | list[dict[str, str]]) -> str:
    """Readable text of a message's content, tool calls written inline as `⟨python⟩expr⟨/python⟩ = result`."""
    if isinstance(content, str):
        return content
    pieces: list[str] = []
    for part in content:
        if part["type"] == "python":
            pieces.append(f"⟨python⟩{part['text']}⟨/python⟩")
        elif part["type"] == "python_output":
            pieces.append(f" = {part['text']}")
        else:
            pieces.append(part["text"])
    return "".join(pieces)
