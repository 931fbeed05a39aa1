"""A model's routing levels, in one place: named operating points of its STT routing that a user picks
(`--routing LEVEL` on `generate`, `batch` and `run`, the TUI's settings).

A level is a router threshold (`STTConfig.router_threshold`'s meaning: a token runs an STT layer when its causal
router's probability is at or above it). A routing fit (`chatapp route`) folds each layer's calibrated cutoff into
its router so that 0.5 is the calibrated point ("quality"); a higher threshold skips more in every layer ("fast").
A model lists its levels in `STTConfig.routing_levels`; the default is the one with the lowest threshold (it computes
most); a model without levels has one, "default" (its own threshold). Every model has "off": every token through every layer.

Plain data, no torch: `chatapp models` reads the levels from config.json without loading anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatapp.errors import SettingsError

OFF_LEVEL = "off"
DEFAULT_ROUTER_THRESHOLD = 0.5  # `STTConfig.router_threshold`'s default, for a config.json that sets none
LEVEL_HINT = "pass one of those to --routing (chatapp models lists them)"


def level_thresholds(levels: Mapping[str, float] | None, router_threshold: float) -> dict[str, float | None]:
    """Level -> threshold (None: routing off), the default first and "off" last. The levels go by threshold, lowest
    first: the default is the level that computes most (config.json keeps no key order, so the order is the
    thresholds')."""
    ordered = sorted((levels or {"default": router_threshold}).items(), key=lambda item: (item[1], item[0]))
    table: dict[str, float | None] = dict(ordered)
    table[OFF_LEVEL] = None
    return table


def pick_level(table: Mapping[str, float | None], requested: str | None) -> str:
    """The level a request runs at: `requested` when the table has it, else the default (the first). The one check
    of a requested level, wherever it comes from (a command's option, a loaded model's settings, the TUI's):
    `SettingsError` naming the levels there are."""
    if requested is None:
        return next(iter(table))
    if requested not in table:
        raise SettingsError(
            f"this model has no routing level {requested!r}; its levels: {', '.join(table)}", hint=LEVEL_HINT
        )
    return requested


def config_level(config: Mapping[str, Any], requested: str | None) -> str:
    """`pick_level` for a model's config.json as read from disk (no model loaded): the check a command makes before
    it starts anything slow; `SettingsError` naming the levels there are."""
    threshold = config.get("router_threshold", DEFAULT_ROUTER_THRESHOLD)
    levels = config.get("routing_levels")
    try:
        return pick_level(level_thresholds(levels if isinstance(levels, Mapping) else None, threshold), requested)
    except TypeError:  # thresholds that are not numbers: loading the model names what is wrong with its config
        return requested or ""
