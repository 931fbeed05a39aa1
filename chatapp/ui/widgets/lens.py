"""The inspector's layers view: what each decoder layer made of the selected token (the logit lens, plain data from
`chatapp.engine.lens`), compact enough for the side panel.

    layers · raw lens · #3 ' can'
    p     ▁▁▁▂▂▃▅▆▇██    the emitted token's probability at each layer's reading (a column per layer)
    ran   ││●│○│●│││    ● a routed layer ran, ○ it skipped (its reading repeats the one below), │ dense
          0       10     layer ruler; ▲ under the layer where the decision was made
    decided at layer 6: p .31 → .98 at the last
    L0  ' the' .12 ' a' .08 ...   the lens's top 3 at the first layer, the middle one, the decision layer, the last

A column per layer keeps a 30-layer model on one line of the 40-column panel; the glyph for "skipped" is a shape,
not only a colour.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from textual.content import Content

from chatapp.engine.lens import ReplyLens, TokenLens

SPARKS = "▁▂▃▄▅▆▇█"
_TOP_TEXT = 8  # characters of an alternative's text


def spark(p: float) -> str:
    """One block for a probability in [0, 1]."""
    return SPARKS[min(int(max(p, 0.0) * len(SPARKS)), len(SPARKS) - 1)]


def ruler(num_layers: int) -> str:
    """Layer numbers every 10 columns, under the sparkline."""
    marks = [" "] * num_layers
    for layer in range(0, num_layers, 10):
        label = str(layer)
        if layer + len(label) <= num_layers:
            marks[layer : layer + len(label)] = label
    return "".join(marks)


def top_layers(token: TokenLens) -> list[int]:
    """The layers whose top 3 are listed: the first, the middle, the decision layer and the last."""
    count = len(token.layers)
    picks = [0, count // 2, *([token.decision_depth] if token.decision_depth is not None else []), count - 1]
    return sorted(set(picks))


def layers_view(result: ReplyLens, token: TokenLens) -> Content:
    """The selected token through the layers (module docstring)."""
    if not token.layers:
        return Content.styled("reading the layers…", "dim")
    parts: list[str | tuple[str, str]] = [
        ("layers · ", "dim"),
        (f"{result.lens} lens", "bold"),
        (f" · #{token.index} ", "dim"),
        (repr(token.text), "bold"),
        "\n",
        ("p   ", "dim"),
    ]
    for layer in token.layers:
        parts.append((spark(layer.prob), "$accent" if layer.rank == 1 else ""))
    parts += ["\n", ("ran ", "dim")]
    for layer in token.layers:
        if not layer.routed:
            parts.append(("│", "dim"))
        else:
            parts.append(("●", "") if layer.computed else ("○", "dim"))
    parts += ["\n", ("    ", "dim"), (ruler(len(token.layers)), "dim")]
    if token.decision_depth is not None:
        parts += ["\n", ("    ", ""), (" " * token.decision_depth + "▲", "bold")]
    last = token.layers[-1]
    if token.decision_depth is None:
        parts += ["\n", (f"never settled: rank {last.rank} at the last layer (p {last.prob:.2f})", "dim")]
    else:
        decided = token.layers[token.decision_depth]
        parts += [
            "\n",
            ("decided at layer ", "dim"),
            (str(token.decision_depth), "bold"),
            (f": p {decided.prob:.2f} → {last.prob:.2f}", "dim"),
        ]
    for index in top_layers(token):
        layer = token.layers[index]
        mark = "" if not layer.routed else " ●" if layer.computed else " ○"
        parts += ["\n", (f"L{index:<2}{mark:2} ", "bold" if index == token.decision_depth else "dim")]
        for alternative in layer.top:
            shown = repr(alternative.text)[1:-1][:_TOP_TEXT]
            style = "bold" if alternative.token == token.token else ""
            parts += [(shown, style), (f" {alternative.prob:.2f} ", "dim")]
    return Content.assemble(*parts)


class RoutedSplit(Protocol):
    """A routed layer's mean of some per-token value over the tokens it computed and over those it skipped."""

    @property
    def computed(self) -> float | None: ...
    @property
    def skipped(self) -> float | None: ...
    @property
    def computed_tokens(self) -> int: ...
    @property
    def skipped_tokens(self) -> int: ...


def split_lines(title: str, splits: Iterable[tuple[int, RoutedSplit]], decimals: int) -> list[str | tuple[str, str]]:
    """A stats-panel table: the dim `title`, then per (layer, split) the computed / skipped means with their counts."""

    def mean(value: float | None, count: int) -> str:
        return f"{value:5.{decimals}f} ({count})" if value is not None else f"{'—':>5} (0)"

    parts: list[str | tuple[str, str]] = ["\n", (title, "dim")]
    for layer, split in splits:
        parts += [
            "\n",
            (f"  L{layer:<3}", "dim"),
            mean(split.computed, split.computed_tokens),
            (" / ", "dim"),
            mean(split.skipped, split.skipped_tokens),
        ]
    return parts


def depth_lines(result: ReplyLens) -> list[str | tuple[str, str]]:
    """The stats panel's lines: per routed layer, the mean decision depth of the tokens it skipped vs ran."""
    splits = result.layer_depths()
    if not splits:
        return []
    return split_lines(f"decision depth ({result.lens})  ran / skipped", ((s.layer, s) for s in splits), decimals=1)
