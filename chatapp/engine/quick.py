"""`chatapp generate "PROMPT"`: stream one reply to the terminal, forced tokens styled apart from sampled ones.

The command (in `chatapp/cli.py`) loads the model and builds the Engine; this module only consumes `Step` events,
so it is what a terminal user sees and what the tests drive. Sampled text prints plain; forced text (tool
output) prints italic cyan, so it differs without colour too; special tokens print as dim markers; a tool call
is visible through its dim markers and forced result; a refused call also prints its reason in red. `--verbose` adds a timing block in the spirit of `ollama run --verbose`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.text import Text

from chatapp.engine.engine import Engine
from chatapp.engine.events import FinishReason, TokenEvent
from chatapp.settings import GenerationSettings

SAMPLED_STYLE = ""
FORCED_STYLE = "italic cyan"
SPECIAL_STYLE = "dim"
REFUSAL_STYLE = "bold red"
ZONE_STYLE = "dim magenta"


@dataclass
class ReplyStats:
    """What one streamed reply cost; `render` writes the `--verbose` block."""

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    tokens: int = 0
    forced: int = 0
    decode_seconds: float = 0.0
    total_seconds: float = 0.0
    # Token x layer slots that ran vs could have run (prompt and reply); STT layers skip some.
    layer_slots: int = 0
    layer_slots_computed: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def compute_saved(self) -> float:
        """Fraction of decoder-layer work the STT layers skipped (0 with routing off)."""
        return 1 - self.layer_slots_computed / self.layer_slots if self.layer_slots else 0.0

    def render(self) -> Text:
        prompt_rate = self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0
        rows = [
            ("total duration", f"{self.total_seconds:.3f}s"),
            ("prompt eval count", f"{self.prompt_tokens} token(s)"),
            ("prompt eval duration", f"{self.prefill_seconds * 1000:.1f}ms"),
            ("prompt eval rate", f"{prompt_rate:.1f} tokens/s"),
            ("eval count", f"{self.tokens} token(s)"),
            ("eval duration", f"{self.decode_seconds:.3f}s"),
            ("eval rate", f"{self.tokens_per_second:.1f} tokens/s"),
            ("forced tokens", f"{self.forced} ({self.forced / self.tokens:.1%})" if self.tokens else "0"),
            ("compute saved", f"{self.compute_saved:.1%} of decoder-layer work (STT routing)"),
            ("finish reason", self.finish_reason or "-"),
        ]
        width = max(len(name) for name, _ in rows) + 2
        return Text("\n".join(f"{name + ':':<{width}}{value}" for name, value in rows), style="dim")


def stream_reply(
    engine: Engine,
    prompt: str,
    settings: GenerationSettings,
    console: Console,
    *,
    verbose: bool = False,
    program: Any = None,
) -> ReplyStats:
    """Stream the reply to `prompt` onto `console` and return its stats (printed too with `verbose`). With a
    compiled TTFA `program`, each zone the reply enters is announced as a dim `[label]` marker."""
    layers = int(engine.model.config.num_hidden_layers)
    dense_layers = layers - len(engine.stt_layers)
    stats = ReplyStats()
    started = time.perf_counter()
    zone: str | None = None
    for step in engine.generate([prompt], settings, programs=None if program is None else [program]):
        if step.prompt is not None:
            stats.prompt_tokens = step.prompt.prompt_tokens[0]
            stats.prefill_seconds = step.prompt.prefill_seconds
            for computed in step.prompt.computed[0] if step.prompt.computed else ():
                stats.layer_slots += layers
                stats.layer_slots_computed += dense_layers + sum(computed)
        stats.decode_seconds += step.seconds
        for event in step.tokens:
            if event.zone is not None and event.zone != zone:
                zone = event.zone
                console.print(Text(f"[{zone}] ", style=ZONE_STYLE), end="")
            _show(console, event)
            stats.tokens += 1
            stats.forced += event.forced
            if event.computed is not None:
                stats.layer_slots += layers
                stats.layer_slots_computed += dense_layers + sum(event.computed)
            if event.finish_reason is not None:
                stats.finish_reason, stats.error = event.finish_reason, event.error
    console.print()
    stats.total_seconds = time.perf_counter() - started
    if stats.error:
        console.print(Text(stats.error, style=REFUSAL_STYLE))
    if verbose:
        console.print(stats.render())
    return stats


def _show(console: Console, event: TokenEvent) -> None:
    """Print one token in the style of its origin; a refused tool call also gets a red note naming the reason.

    A successful call needs no note: its markers print dim and its forced result italic cyan.
    """
    if event.finish_reason == "stop" and event.special:
        return  # the end-of-turn marker is not part of the reply
    style = SPECIAL_STYLE if event.special else FORCED_STYLE if event.forced else SAMPLED_STYLE
    if event.text:
        console.print(Text(event.text, style=style), end="", soft_wrap=True)
    tool = event.tool
    if tool is not None and tool.kind == "refusal":
        console.print(Text(f" [{tool.tool} refused {tool.expression!r}: {tool.output}] ", style=REFUSAL_STYLE), end="")
