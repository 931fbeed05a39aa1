"""Side-panel widgets: zone-tag pills, the selected token's details, and generation stats."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from textual.content import Content

from chatapp.engine.events import TokenEvent
from chatapp.engine.lens import ReplyLens
from chatapp.engine.reply import Reply
from chatapp.ui.backend import ProgramInfo
from chatapp.ui.tokens import display_text
from chatapp.ui.widgets.heatmap import probability_colour
from chatapp.ui.widgets.lens import depth_lines, layers_view, split_lines
from chatapp.ui.widgets.live import LiveStatic, PaintThrottle
from chatapp.ui.widgets.probability import bar


class ZonePills(LiveStatic):
    """The active program's zone tags; the tags of the latest token's zone are lit (● and reversed) live."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.program: ProgramInfo | None = None
        self.active: tuple[str, ...] = ()
        self.zone: str | None = None

    def on_mount(self) -> None:
        self._redraw()

    def set_program(self, program: ProgramInfo | None) -> None:
        self.program, self.active, self.zone = program, (), None
        self._redraw()

    def set_active(self, tags: Sequence[str], zone: str | None) -> None:
        tags = tuple(tags)
        if (tags, zone) != (self.active, self.zone):
            self.active, self.zone = tags, zone
            self._redraw()

    def _redraw(self) -> None:
        if self.program is None:
            self.border_title = "program: none"
            self.show_content(Content.styled("no TTFA program: every token is sampled", "dim"))
            return
        self.border_title = f"program: {self.program.name}"
        if not self.program.tags:
            self.show_content(Content.styled("this program declares no zone tags", "dim"))
            return
        parts: list[str | tuple[str, str]] = []
        for tag in self.program.tags:
            lit = tag in self.active
            parts.append((f" {'●' if lit else '○'} {tag} ", "bold reverse $accent" if lit else "$text-muted"))
            parts.append(" ")
        if self.zone:
            parts.append(("\nzone ", "dim"))
            parts.append(self.zone)
        self.show_content(Content.assemble(*parts))


class TokenInspector(LiveStatic):
    """Everything known about the selected token: id, forced or sampled, zone tags, per-layer routing, and what the
    model weighed: its probability, surprise and entropy, and the alternatives with bars. With the layer lens on
    (f7, or a click here), its layers view instead (`widgets/lens.py`)."""

    def __init__(self, stt_layers: Sequence[int] = (), *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.stt_layers = tuple(stt_layers)
        self.border_title = "token"

    async def on_click(self) -> None:
        await self.run_action("app.toggle_lens")

    def show_lens(self, result: ReplyLens | None, index: int | None, note: str | None = None) -> None:
        """The layers view of token `index` of `result` (None: `note`, e.g. while the lens is read)."""
        self.border_title = "token · layers"
        token = None if result is None or index is None else result.token(index)
        if token is None:
            self.show_content(Content.styled(note or "select a token to see its layers", "dim"))
            return
        self.show_content(layers_view(result, token))

    def on_mount(self) -> None:
        self.show(None)

    def set_layers(self, stt_layers: Sequence[int]) -> None:
        """The model's STT layers, given once it has loaded (the app draws before it has)."""
        self.stt_layers = tuple(stt_layers)

    def show(self, event: TokenEvent | None, index: int | None = None) -> None:
        self.border_title = "token"
        if event is None:
            self.show_content(Content.styled("click a token, or shift+tab then ←/→", "dim"))
            return
        shown = display_text(event)
        parts: list[str | tuple[str, str]] = [
            (f"#{index} " if index is not None else "", "dim"),
            (repr(shown), "bold"),
            f"  id {event.token}\n",
            ("forced", "underline $accent") if event.forced else "sampled",
            ("  special" if event.special else "", "$warning"),
            "\n",
            ("zone ", "dim"),
            event.zone or "—",
            ("  tags ", "dim"),
            ", ".join(event.tags) or "—",
        ]
        if event.tool is not None:
            parts += ["\n", ("tool ", "dim"), f"{event.tool.kind} {event.tool.expression}"]
            if event.tool.output is not None:
                parts.append(f" → {event.tool.output}")
        if event.router_probs is None or event.computed is None:
            parts += ["\n", ("routing: not fed to the model", "dim")]
        else:
            for layer, p, computed in zip(self.stt_layers, event.router_probs, event.computed, strict=False):
                # The glyph matches the heatmap's cell: coloured block when computed, dot when skipped.
                glyph = ("█", probability_colour(p)) if computed else ("·", "dim")
                parts += ["\n", (f"L{layer:<3}", "dim"), f"{p:5.2f} ", glyph, " computed" if computed else " skipped"]
        if event.logprobs is not None:
            parts += _logprob_parts(event)
        self.show_content(Content.assemble(*parts))


ALTERNATIVE_BAR = 12  # cells of an alternative's probability bar
_ALTERNATIVE_TEXT = 12  # characters of an alternative's text


def _logprob_parts(event: TokenEvent) -> list[str | tuple[str, str]]:
    """The model's view of the token: log p, p, surprise and entropy, then its alternatives with bars (the
    emitted one marked ◀; one the sampling distribution could not draw — masked by top-k/p or the grammar — dim)."""
    logprobs = event.logprobs
    assert logprobs is not None
    parts: list[str | tuple[str, str]] = [
        "\n",
        ("log p ", "dim"),
        f"{logprobs.logprob:.3f}",
        ("  p ", "dim"),
        f"{logprobs.probability:.3f}",
        ("  entropy ", "dim"),
        f"{logprobs.entropy:.2f}",
        "\n",
        ("surprise ", "dim"),
        f"{logprobs.surprise:.2f} nats",
    ]
    if logprobs.sampling_logprob is not None:
        parts += [("  sampled p ", "dim"), f"{math.exp(logprobs.sampling_logprob):.3f}"]
    elif event.forced:
        parts += [("  forced: not drawn", "dim")]
    drawable = {a.token for a in logprobs.sampling_top} if logprobs.sampling_top else None
    for alternative in logprobs.top:
        p = math.exp(alternative.logprob)
        shown = repr(alternative.text)[1:-1][:_ALTERNATIVE_TEXT]
        masked = drawable is not None and alternative.token not in drawable and len(drawable) < len(logprobs.top)
        style = "dim" if masked else ""
        parts += [
            "\n",
            (f"{shown:<{_ALTERNATIVE_TEXT}} ", "bold" if alternative.token == event.token else style),
            (bar(p, ALTERNATIVE_BAR), "$accent" if not masked else "dim"),
            (f" {p:5.3f}", style),
            (" ◀" if alternative.token == event.token else "", "bold"),
        ]
    return parts


STATS_INTERVAL = 0.25  # seconds between live updates of the stats text: readable, and cheap next to ~30 batches/s


class StatsPanel(LiveStatic):
    """Tokens/s, forced share, compute saved and context use of the current (or last) answer."""

    def __init__(self, *, id: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(id=id)
        self.border_title = "stats"
        self._throttle = PaintThrottle(self, STATS_INTERVAL, lambda: self.show(self._stats), clock)
        self._stats = Reply()
        self._lens: ReplyLens | None = None  # the shown answer's layer lens, with the lens on

    def on_mount(self) -> None:
        self.show(Reply())

    def show_live(self, stats: Reply) -> None:
        """Show running figures at most every `STATS_INTERVAL` (digits changing 30 times a second are unreadable,
        and each change repaints the side panel: `PaintThrottle`). Figures held back are shown soon after, so a
        pause in the stream never leaves them stale. `stats` is the answer's live counter, read when shown."""
        if stats is not self._stats:
            self._stats, self._lens = stats, None
        self._throttle.request()

    def show_lens(self, result: ReplyLens | None) -> None:
        """Add (or, with None, drop) the decision-depth lines of the shown answer's layer lens."""
        self._lens = result
        self.show(self._stats)

    def show(self, stats: Reply) -> None:
        if stats is not self._stats:
            self._stats, self._lens = stats, None
        self._throttle.painted()
        context = f"{stats.context_used}/{stats.context_size}" if stats.context_size else str(stats.context_used)
        rows = [
            ("tokens/s", f"{stats.tokens_per_second:.1f}"),
            ("tokens", f"{stats.emitted}  (prompt {stats.prompt_tokens})"),
            ("forced", f"{stats.forced_fraction:.0%}"),
            ("compute saved", f"{stats.compute_saved:.0%}  (STT skip {stats.stt_skipped_fraction:.0%})"),
            ("context", context),
        ]
        if stats.mean_surprise is not None:
            rows.append(("surprise", f"{stats.mean_surprise:.2f} nats/token"))
        parts: list[str | tuple[str, str]] = []
        for i, (name, value) in enumerate(rows):
            parts += ["\n" if i else "", (f"{name:<14}", "dim"), value]
        parts += _layer_surprise_parts(stats)
        if self._lens is not None:
            parts += depth_lines(self._lens)
        self.show_content(Content.assemble(*parts))


def _layer_surprise_parts(stats: Reply) -> list[str | tuple[str, str]]:
    """Per STT layer: mean surprise of the tokens it computed vs skipped (does routing follow surprise?)."""
    layers = stats.layer_surprise()
    if not layers:
        return []
    return split_lines("mean -log p    computed / skipped", layers.items(), decimals=2)
