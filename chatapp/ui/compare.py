"""Compare an answer with the same answer regenerated with STT routing off: where do they part?

The backend regenerates the last answer with routing off and nothing else changed (same seed, settings, program
and constraint; `ChatBackend.compare_last`), leaving the conversation as it was. Routing changes which layers
compute each token, so the logits, and from some token on possibly the text, change; the first token where the
two answers differ is what routing changed first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chatapp.engine.events import TokenEvent
from chatapp.ui.tokens import display_text


@dataclass(frozen=True)
class Comparison:
    """Two answers to one message: `routed` (as shown) and `unrouted` (routing off), and where they diverge."""

    routed: tuple[TokenEvent, ...]
    unrouted: tuple[TokenEvent, ...]
    divergence: int | None  # index of the first differing token; None when the token lists are identical

    @classmethod
    def of(cls, routed: Sequence[TokenEvent], unrouted: Sequence[TokenEvent]) -> Comparison:
        return cls(tuple(routed), tuple(unrouted), first_divergence(routed, unrouted))

    @property
    def summary(self) -> str:
        """One line: "identical", or "diverges at token 17: ' Paris' vs ' London'"."""
        if self.divergence is None:
            return f"identical ({len(self.routed)} tokens)"
        index = self.divergence
        return f"diverges at token {index}: {_shown(self.routed, index)} vs {_shown(self.unrouted, index)}"


def first_divergence(a: Sequence[TokenEvent], b: Sequence[TokenEvent]) -> int | None:
    """The index of the first token id that differs (the shorter answer's end counts as a difference)."""
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x.token != y.token:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def _shown(events: Sequence[TokenEvent], index: int) -> str:
    return repr(display_text(events[index])) if index < len(events) else "(end)"
