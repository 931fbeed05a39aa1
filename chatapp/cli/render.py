"""`chatapp generate "PROMPT"`: stream one reply to the terminal, or its exact text to a pipe.

The command (in `chatapp/cli/table.py`) loads the model and builds the Engine; this module only consumes `Step` events
and folds them with the engine's reply fold (`chatapp/engine/reply.py`), so its numbers are the TUI's and the batch records'.

On a terminal, sampled text prints plain; forced text (tool output) prints italic cyan, so it differs without
colour too; special tokens print dim; a refused tool call also prints its reason in red; a TTFA zone the reply
enters is announced as a dim `[label]`. Into a pipe or file the reply's text is written exactly as the tokens
decode (no styling, wrapping or tab expansion, no zone labels), and the error and `--verbose` block go to stderr.
`--verbose` adds a timing block in the spirit of `ollama run --verbose`; `--logprobs N` a table of every reply
token's probability, the model's entropy and its N most likely alternatives (on stderr too when piped).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from chatapp.engine.engine import Engine
from chatapp.engine.events import TokenEvent
from chatapp.engine.reply import Reply
from chatapp.settings import SAMPLING_FIELDS, SOURCE_LABELS, GenerationSettings, SettingSource

SAMPLED_STYLE = ""
FORCED_STYLE = "italic cyan"
SPECIAL_STYLE = "dim"
REFUSAL_STYLE = "bold red"
ZONE_STYLE = "dim magenta"


def render_stats(reply: Reply, total_seconds: float, routing_level: str | None = None) -> Text:
    """The `--verbose` block: what the reply cost, with the reply fold's definitions, at `routing_level`."""
    prompt_rate = reply.prompt_tokens / reply.prefill_seconds if reply.prefill_seconds > 0 else 0.0
    forced = f"{reply.forced_count} ({reply.forced_fraction:.1%})" if reply.emitted else "0"
    rows = [
        ("total duration", f"{total_seconds:.3f}s"),
        ("prompt eval count", f"{reply.prompt_tokens} token(s)"),
        ("prompt eval duration", f"{reply.prefill_seconds * 1000:.1f}ms"),
        ("prompt eval rate", f"{prompt_rate:.1f} tokens/s"),
        ("eval count", f"{reply.emitted} token(s)"),
        ("eval duration", f"{reply.decode_seconds:.3f}s"),
        ("eval rate", f"{reply.tokens_per_second:.1f} tokens/s"),
        ("forced tokens", forced),
        (
            "compute saved",
            f"{reply.compute_saved:.1%} of the reply's decoder-layer work, net "
            f"(STT routing; {reply.stt_skipped_fraction:.1%} of the STT layers' work)",
        ),
        ("routing level", routing_level or "-"),
        ("finish reason", reply.finish_reason or "-"),
    ]
    width = max(len(name) for name, _ in rows) + 2
    return Text("\n".join(f"{name + ':':<{width}}{value}" for name, value in rows), style="dim")


def render_logprobs(reply: Reply) -> Table:
    """The `--logprobs N` table: per reply token, its probability under the model, the model's surprise and
    entropy, and the alternatives it weighed (forced tokens marked: the model did not choose them)."""
    table = Table(box=None, pad_edge=False, header_style="dim", title_style="dim", title_justify="left")
    table.title = f"log-probabilities (natural log; mean surprise {reply.mean_surprise or 0:.2f} nats)"
    for name, justify in (("#", "right"), ("token", "left"), ("", "left"), ("logprob", "right"), ("p", "right"),
                          ("entropy", "right"), ("alternatives (p)", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for index, (event, logprobs) in enumerate(zip(reply.events, reply.logprobs, strict=False)):
        if logprobs is None:
            continue
        alternatives = "  ".join(f"{a.text!r} {math.exp(a.logprob):.2f}" for a in logprobs.top)
        table.add_row(
            str(index),
            Text(repr(logprobs.piece.decode("utf-8", errors="replace")), style=FORCED_STYLE if event.forced else ""),
            "forced" if event.forced else "",
            f"{logprobs.logprob:.3f}",
            f"{logprobs.probability:.3f}",
            f"{logprobs.entropy:.2f}",
            alternatives,
        )
    return table


def render_sampling(settings: GenerationSettings, sources: Mapping[str, SettingSource]) -> Text:
    """The `--verbose` sampling block: each sampling value in use and where it came from (an option, the model's
    generation_config.json, chatapp's built-in default)."""
    width = max(len(name) for name in SAMPLING_FIELDS) + 2
    lines = []
    for name in SAMPLING_FIELDS:
        value = getattr(settings, name)
        shown = json.dumps(list(value)) if isinstance(value, tuple) else str(value)
        lines.append(f"{name + ':':<{width}}{shown}  ({SOURCE_LABELS[sources[name]]})")
    return Text("\n".join(lines), style="dim")


def stream_reply(
    engine: Engine,
    prompt: str,
    settings: GenerationSettings,
    console: Console,
    *,
    exact: TextIO | None = None,
    verbose: bool = False,
    program: Any = None,
    constraint: Any = None,
    sources: Mapping[str, SettingSource] | None = None,
) -> Reply:
    """Stream the reply to `prompt` and return it folded. Styled onto `console`, or, with `exact`, its text written
    verbatim to `exact` while `console` gets only the error and the `--verbose` block. `program` is a compiled TTFA
    program, `constraint` a regex string or a `chatapp.trie` Constraint. With `verbose`, `sources` (where each
    sampling value came from) adds the sampling block before the timing one."""
    reply = engine.new_reply()
    started = time.perf_counter()
    zone: str | None = None
    steps = engine.generate(
        [prompt],
        settings,
        programs=None if program is None else [program],
        constraints=None if constraint is None else [constraint],
    )
    for step in steps:
        if step.prompt is not None:
            reply.start(step.prompt)
        reply.decode_seconds += step.seconds
        for event in step.tokens:
            text = reply.add(event)
            if exact is not None:
                exact.write(text)
                exact.flush()
                continue
            if event.zone is not None and event.zone != zone:
                zone = event.zone
                console.print(Text(f"[{zone}] ", style=ZONE_STYLE), end="")
            _show(console, event, text)
    if exact is None:
        console.print()
    total_seconds = time.perf_counter() - started
    if reply.error:
        console.print(Text(reply.error, style=REFUSAL_STYLE))
    if verbose:
        if sources is not None:
            console.print(render_sampling(settings, sources))
        console.print(render_stats(reply, total_seconds, settings.routing_level))
    if settings.logprobs:
        console.print(render_logprobs(reply))
    return reply


def _show(console: Console, event: TokenEvent, text: str) -> None:
    """Print one token's reply text in the style of its origin; a refused tool call also gets a red note.

    A successful call needs no note: its markers print dim and its forced result italic cyan.
    """
    style = SPECIAL_STYLE if event.special else FORCED_STYLE if event.forced else SAMPLED_STYLE
    if text:
        console.print(Text(text, style=style), end="", soft_wrap=True)
    tool = event.tool
    if tool is not None and tool.kind == "refusal":
        console.print(Text(f" [{tool.tool} refused {tool.expression!r}: {tool.output}] ", style=REFUSAL_STYLE), end="")
