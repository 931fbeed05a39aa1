"""How a token's probability and surprise are drawn, in one place for the transcript, the inspector and the
surprise row under the heatmap.

Surprise is -log p in nats under the model's own distribution (`TokenLogprobs`). Both scales are binned, so a
style or glyph is chosen from a handful, and every view of one token agrees.
"""

from __future__ import annotations

import math

# Probability bins for the transcript's colouring: a likely token stays plain, an unlikely one gets warmer.
# (lower bound of p, background colour); checked from the top.
_PROBABILITY_BINS = (
    (0.9, None),
    (0.5, "#3b4d2a"),
    (0.2, "#5c5a1e"),
    (0.05, "#6b3d12"),
    (0.0, "#7a1f1f"),
)

# Surprise bins (nats) for the shaded row: ' ' certain, then ░ ▒ ▓ █ as -log p grows (p ~ 0.9, 0.5, 0.2, 0.05).
SURPRISE_SHADES = " ░▒▓█"
_SURPRISE_EDGES = (-math.log(0.9), -math.log(0.5), -math.log(0.2), -math.log(0.05))


def probability_background(p: float) -> str | None:
    """The background colour of a sampled token of probability `p` when the transcript colours by probability
    (None: likely enough to stay plain)."""
    for lower, colour in _PROBABILITY_BINS:
        if p >= lower:
            return colour
    return _PROBABILITY_BINS[-1][1]


def surprise_level(surprise: float) -> int:
    """0 (certain) .. 4 (p < 0.05): the bin of `surprise` (nats)."""
    return sum(surprise >= edge for edge in _SURPRISE_EDGES)


def surprise_shade(surprise: float) -> str:
    return SURPRISE_SHADES[surprise_level(surprise)]


def surprise_colour(surprise: float) -> str | None:
    """The colour of a surprise cell: the transcript's background of the same probability."""
    return probability_background(math.exp(-surprise))


def bar(fraction: float, width: int) -> str:
    """A horizontal bar of `fraction` (0..1) in `width` cells, in eighths."""
    eighths = round(min(max(fraction, 0.0), 1.0) * width * 8)
    full, rest = divmod(eighths, 8)
    return ("█" * full + (" ▏▎▍▌▋▊▉"[rest] if rest else "")).ljust(width)


LEGEND = "p ≥ .9 plain · ≥ .5 · ≥ .2 · ≥ .05 · < .05"
