"""`stop` strings: a reply ends where its text first contains one of them, and the stop string is not returned.

Text arrives a token at a time, and a stop string can span tokens, so text that could still turn out to be the
start of a stop string is held back until the next token decides it: a stream never shows text that a stop
string later takes back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    """What one push of text released: the text safe to show now, and whether a stop string ended the reply."""

    text: str
    stopped: bool


class StopMatcher:
    """Finds the first occurrence of any stop string in text pushed piece by piece."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._held = ""

    @property
    def held(self) -> str:
        """Text pushed but not yet released: it may be the start of a stop string."""
        return self._held

    def push(self, text: str) -> StopCheck:
        """Add `text`; release what can no longer be part of a stop string, up to the first stop string."""
        if not self.stops:
            return StopCheck(text, False)
        buffer = self._held + text
        found = [at for stop in self.stops if (at := buffer.find(stop)) >= 0]
        if found:
            self._held = ""
            return StopCheck(buffer[: min(found)], True)
        keep = self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return StopCheck(buffer[: len(buffer) - keep], False)

    def flush(self) -> str:
        """The held text, when the reply ended without a stop string."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that a stop string starts with (a stop string may yet follow)."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
