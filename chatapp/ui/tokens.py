"""How a token reads in the transcript: its text, or a readable marker for a special token.

Nothing here knows about Textual. The reply's content and display segments come from the engine's one reply fold
(`chatapp.engine.reply.Reply`); this module only names tokens.
"""

from __future__ import annotations

from chatapp.engine.events import TokenEvent

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
