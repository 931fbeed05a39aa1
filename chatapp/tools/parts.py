"""A message's content parts (nanochat's: text, a tool call, its output) and how they read as text.

One `PartType` for the whole app: the chat formats validate and render parts, the reply fold builds them from
tokens (through `ToolMarkers.part_after`), and the copy / export / history views write them out with `content_text`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

PartType = Literal["text", "python", "python_output"]
PART_TYPES: tuple[str, ...] = ("text", "python", "python_output")

Content = str | list[dict[str, str]]
"""A message's content: a string, or a list of `{"type": PartType, "text": str}` parts."""

# How each part type is written out as text: (before, after) its text.
PLAIN_WRAP: Mapping[str, tuple[str, str]] = {
    "text": ("", ""),
    "python": ("⟨python⟩", "⟨/python⟩"),
    "python_output": (" = ", ""),
}
MARKDOWN_WRAP: Mapping[str, tuple[str, str]] = {
    "text": ("", ""),
    "python": ("\n\n```python\n", "\n```\n"),
    "python_output": ("\n```text\n", "\n```\n\n"),
}


def content_text(content: Content | Sequence[Mapping[str, str]], wrap: Mapping[str, tuple[str, str]] = PLAIN_WRAP) -> str:
    """Readable text of a message's content: tool calls and results written inline with `wrap` (plain text by
    default, `MARKDOWN_WRAP` for an export)."""
    if isinstance(content, str):
        return content
    return "".join(wrap[part["type"]][0] + part["text"] + wrap[part["type"]][1] for part in content)
