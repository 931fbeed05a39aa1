"""`chatapp lens "PROMPT"`: what each layer made of a reply's tokens; `chatapp lens fit MODEL`: a model's tuned lens.

`chatapp lens` generates a reply (or teacher-forces `--reply`), replays it through the logit lens
(`chatapp.engine.lens`) with the routing it had, and prints every token's decision depth: the first layer from which
the lens's top token stays the emitted one. `--at N` adds token N's per-layer table (the emitted token's probability
and rank, the top 3, computed or skipped); `--json` prints the same as one JSON document for scripts.

The `lens` group runs `show` when its first argument is not a subcommand's name, so `chatapp lens "PROMPT"` needs no
`show` (a prompt that is literally "fit" is `chatapp lens show fit`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

import chatapp.cli.options as opt
from chatapp.cli.options import DeviceOption, DtypeOption, ModelOption
from chatapp.errors import ContextOverflowError, SettingsError

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table

    from chatapp.engine.lens import ReplyLens, TokenLens

LENS_KINDS = ("auto", "raw", "tuned")
GENERAL_SEED = 4242  # the general prompts a lens is fitted on (apart from the recipe's training draws)
GENERAL_TOKENS = 64  # tokens of the model's own answer to each


class LensGroup(TyperGroup):
    """`lens` with `show` as the default subcommand: `chatapp lens "PROMPT"` is `chatapp lens show "PROMPT"`."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["show", *args]
        return super().parse_args(ctx, args)


lens_app = typer.Typer(
    cls=LensGroup,
    help="The logit lens: what each layer made of a reply's tokens (see `chatapp lens show --help`).",
    no_args_is_help=True,
)



@lens_app.command("show")
def show(
    prompt: Annotated[str, typer.Argument(help="The prompt, sent as one user turn.")],
    reply: Annotated[
        str | None, typer.Option("--reply", help="Teacher-force this reply instead of generating one.")
    ] = None,
    at: Annotated[
        int | None, typer.Option("--at", help="Also print token N's per-layer table (N as in the # column).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document (every token, the tables).")] = False,
    lens: Annotated[
        str, typer.Option("--lens", help="raw (the model's own head), tuned (fitted translators) or auto.")
    ] = "auto",
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most sampled tokens of a generated reply.")] = 128,
    temperature: opt.TemperatureOption = None,
    top_k: opt.TopKOption = None,
    top_p: opt.TopPOption = None,
    min_p: opt.MinPOption = None,
    repetition_penalty: opt.RepetitionPenaltyOption = None,
    presence_penalty: opt.PresencePenaltyOption = None,
    frequency_penalty: opt.FrequencyPenaltyOption = None,
    repeat_last_n: opt.RepeatLastNOption = None,
    dry_multiplier: opt.DryMultiplierOption = None,
    dry_base: opt.DryBaseOption = None,
    dry_allowed_length: opt.DryAllowedLengthOption = None,
    dry_penalty_last_n: opt.DryPenaltyLastNOption = None,
    dry_sequence_breakers: opt.DrySequenceBreakersOption = None,
    seed: Annotated[int, typer.Option("--seed", help="Random seed for sampling.")] = 0,
) -> None:
    """Print every reply token's decision depth: the first layer from which the logit lens's top token stays the
    emitted one (`-` where the model's own top token was another: a sampled or forced token)."""
    from chatapp.settings import GenerationSettings
    from chatapp.validation import check_text

    check_text("the prompt", prompt)
    if not prompt.strip():
        raise SettingsError("the prompt is empty", hint='give the lens something to answer, e.g. chatapp lens "Hi"')
    if reply is not None:
        check_text("--reply", reply)
        if not reply:
            raise SettingsError("--reply is empty", hint="leave --reply out to generate a reply")
    if at is not None and at < 0:
        raise SettingsError(f"--at {at} is not a token index", hint="use a # from the table, 0 or more")
    if lens not in LENS_KINDS:
        raise SettingsError(f"--lens {lens!r} is not a lens", hint="use raw, tuned or auto")
    chosen = opt.chosen_sampling(locals())
    settings = GenerationSettings(max_tokens=max_tokens, seed=seed).with_(**chosen)
    from chatapp.lifecycle import starting_up

    with starting_up():
        from chatapp.models import load_engine, resolve_model

        engine = load_engine(model, device, dtype=dtype)
    settings = engine.default_settings(settings, chosen)  # the model's own sampling under the options
    translators = _translators(lens, resolve_model(model), engine)
    clock = Stopwatch()
    result = run_lens(engine, prompt, reply, settings, at=at, translators=translators, lap=clock.lap)
    if as_json:
        typer.echo(json.dumps(lens_document(result, at), ensure_ascii=False))
        return
    console = Console(highlight=False)
    console.print(render_depths(result))
    if at is not None:
        console.print(render_layers(result, result.tokens[at]))
    Console(stderr=True, highlight=False).print(f"[dim]{clock.report()}[/]")


class Stopwatch:
    """Wall and CPU seconds of the command's phases (generating the reply, reading it through the lens): on a shared
    machine the CPU seconds say what the work costs, the wall seconds what the wait was."""

    def __init__(self) -> None:
        self.laps: list[tuple[str, float, float]] = []
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def lap(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        self.laps.append((name, wall - self._wall, cpu - self._cpu))
        self._wall, self._cpu = wall, cpu

    def report(self) -> str:
        return "; ".join(f"{name} {wall:.2f} s (CPU {cpu:.2f} s)" for name, wall, cpu in self.laps)


def run_lens(
    engine, prompt: str, reply: str | None, settings, *, at: int | None, translators=None, lap=lambda name: None
) -> ReplyLens:
    """Generate (or teacher-force) the reply to `prompt` and read it through the lens; `at` gets a full table.
    `lap(name)` is called as each phase ends ("generation", "lens")."""
    from chatapp.engine.lens_pass import conversation_lens, reply_lens
    from chatapp.engine.loop import call_routing

    # The lens replays at the routing the reply is generated with (or, teacher-forced, would have been).
    routing, threshold = call_routing(engine.model.config, settings)
    dense = routing == "off"
    prompt_ids = engine.chat_format.render_for_completion([{"role": "user", "content": prompt}])
    context = int(engine.context_size)
    if len(prompt_ids) >= context:
        raise ContextOverflowError(
            f"the prompt is {len(prompt_ids)} tokens, and the model's context holds {context}: no room for a reply",
            hint=f"shorten the prompt to fewer than {context} tokens",
        )
    if reply is not None:
        forced = engine.chat_format.encode_text(reply)
        if not forced:
            raise SettingsError("--reply encodes to no tokens", hint="give some text to teacher-force")
        if len(prompt_ids) + len(forced) > context:
            # Positions past the context have no rotary position the model was made for: the reading would be noise.
            raise ContextOverflowError(
                f"--reply is {len(forced)} tokens; with the prompt's {len(prompt_ids)} that is "
                f"{len(prompt_ids) + len(forced)}, more than the model's context of {context} tokens",
                hint=f"shorten --reply to at most {context - len(prompt_ids)} tokens (or shorten the prompt)",
            )
        _check_at(at, len(forced))
        ids = [*prompt_ids, *forced]
        targets = range(len(prompt_ids), len(ids))
        tables = [] if at is None else [at]
        return conversation_lens(
            engine, ids, targets, tables=tables, dense=dense, threshold=threshold, translators=translators
        )
    answer = engine.new_reply()
    for step in engine.generate([prompt], settings):
        answer.add_step(step)
    _check_at(at, len(answer.events))
    lap(f"generation of {len(answer.events)} tokens")
    result = reply_lens(
        engine,
        prompt_ids,
        answer,
        tables=[] if at is None else [at],
        dense=dense,
        threshold=threshold,
        translators=translators,
    )
    lap("lens")
    return result


def _check_at(at: int | None, count: int) -> None:
    if at is not None and at >= count:
        raise SettingsError(
            f"--at {at} is past the reply's last token ({count} tokens, # 0 to {count - 1})",
            hint=f"use --at between 0 and {count - 1}",
        )


def _translators(kind: str, model_dir: Path, engine):
    """The tuned lens's translators for `--lens` (None: the raw lens)."""
    if kind == "raw":
        return None
    from chatapp.models.lens_files import lens_translators

    translators = lens_translators(model_dir, engine.model.config)
    if translators is None and kind == "tuned":
        raise SettingsError(
            f"the model {model_dir} has no tuned lens",
            hint=f"fit one with `chatapp lens fit {model_dir}`, or use --lens raw",
        )
    return translators


# ------------------------------------------------------------------------------------------------------ rendering
def render_depths(result: ReplyLens) -> Group:
    """One row per reply token: its text, its decision depth, and the routed layers that ran where it was predicted;
    then the mean depth, over all tokens and split by what each routed layer did."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from chatapp.engine.lens import depth_block

    routed = " ".join(map(str, result.stt_layers)) or "none"
    header = Text(
        f"decision depth, {result.lens} lens: the first of layers 0-{result.num_layers - 1} from which the top "
        f"reading stays the token\nrouted layers {routed} ({result.skip_mode} skip mode): ● ran, ○ skipped",
        style="dim",
    )
    table = Table(box=None, pad_edge=False, header_style="dim")
    for name, justify in (("#", "right"), ("token", "left"), ("depth", "right"), ("", "left"), ("routed", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for token in result.tokens:
        table.add_row(
            str(token.index),
            repr(token.text),
            "-" if token.decision_depth is None else str(token.decision_depth),
            depth_block(token.decision_depth, result.num_layers),
            "".join("●" if ran else "○" for ran in token.computed),
        )
    settled = [t.decision_depth for t in result.tokens if t.decision_depth is not None]
    mean = f"{sum(settled) / len(settled):.1f}" if settled else "-"
    lines = [f"mean depth {mean} over the {len(settled)} of {len(result.tokens)} tokens the model ranked first"]
    lines += [
        f"layer {s.layer}: mean depth {_mean(s.skipped)} where it skipped ({_tokens(s.skipped_tokens)}), "
        f"{_mean(s.computed)} where it ran ({_tokens(s.computed_tokens)})"
        for s in result.layer_depths()
    ]
    return Group(header, table, Text("\n".join(lines), style="dim"))


def _mean(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _tokens(count: int) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def render_layers(result: ReplyLens, token: TokenLens) -> Table:
    """Token N's per-layer table: the emitted token's probability and rank at each layer, computed or skipped, the
    lens's top 3, and the layer where the decision was made."""
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, header_style="dim", title_style="dim", title_justify="left")
    table.title = f"token {token.index} {token.text!r}, layer by layer ({result.lens} lens)"
    rows = [
        (
            str(layer.layer),
            Text(
                "ran" if not layer.routed else "● ran" if layer.computed else "○ skipped",
                style="" if layer.computed else "dim",
            ),
            f"{layer.prob:.3f}",
            str(layer.rank),
            "◀ decided" if layer.layer == token.decision_depth else "",
            "  ".join(f"{alt.text!r} {alt.prob:.2f}" for alt in layer.top),
        )
        for layer in token.layers
    ]
    columns = (("layer", "right"), ("", "left"), ("p", "right"), ("rank", "right"), ("", "left"))
    for index, (name, justify) in enumerate(columns):
        # Never narrowed: squeezed into a pipe's 80 columns, a number cut to `0.…` says nothing. The top 3 takes what
        # is left, wrapped onto more lines where it must be.
        widest = max([len(name), *(len(str(row[index])) for row in rows)])
        table.add_column(name, justify=justify, no_wrap=True, min_width=widest)  # type: ignore[arg-type]
    table.add_column("top 3", justify="left", overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def lens_document(result: ReplyLens, at: int | None) -> dict[str, Any]:
    """The `--json` document: the lens's facts, every token, each routed layer's depth split."""
    document = dataclasses.asdict(result)
    document["layer_depths"] = [dataclasses.asdict(split) for split in result.layer_depths()]
    document["at"] = at
    return document


# ------------------------------------------------------------------------------------------------------- fitting
@lens_app.command("fit")
def fit(
    model: Annotated[str, typer.Argument(help="A model name (tiny, default) or a model directory.")],
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            help="Where the translators go: a new file, or a lens file written earlier (default: the data "
            "directory's lenses/, where `chatapp lens` looks first).",
        ),
    ] = None,
    conversations: Annotated[
        int, typer.Option("--conversations", min=2, help="Held-out chat conversations: half to fit, half to measure.")
    ] = 64,
    steps: Annotated[int, typer.Option("--steps", min=0, help="Adam steps on the KL after least squares.")] = 200,
    rank: Annotated[
        int,
        typer.Option(
            "--rank",
            min=1,
            help="Rank of each layer's translator (at most the model's width; fewer when the fit has fewer positions).",
        ),
    ] = 32,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
) -> None:
    """Fit a tuned lens for MODEL: per layer a low-rank affine translator, least squares then Adam on the KL to the
    model's distribution, on cached states of held-out chat. Prints each layer's agreement with the model, raw and
    tuned, on conversations the fit did not see."""
    from chatapp.lifecycle import starting_up

    with starting_up():
        from chatapp.models import load_engine, resolve_model
        from chatapp.models.lens_files import check_lens_output, fitted_path, save_translators
        from chatapp.models.loader import check_model_dir
        from chatapp.training.lens_fit import fit_lens

        # The output is checked before the model loads and the fit runs (minutes): never over a file chatapp did
        # not write, and the user-fitted lens lives in the data directory, where preparing a model again does not
        # reach it.
        model_dir = resolve_model(model)
        what = "-o file" if output else "lens file"
        target = Path(output).expanduser() if output else fitted_path(model_dir)
        check_lens_output(target, what)
        width = check_model_dir(model_dir).get("hidden_size")
        if isinstance(width, int) and rank > width:  # else loading names what is wrong with the config
            raise SettingsError(
                f"--rank {rank} is more than the model's width ({width}): a translator's rank is at most its width",
                hint=f"pass --rank {width} or less",
            )
        engine = load_engine(model, device, dtype=dtype)
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    chats = held_out_conversations(engine, model_dir, conversations, log)
    try:
        report = fit_lens(engine, chats, steps=steps, rank=rank, log=log)
    except ValueError as err:  # conversations without an assistant token to read
        raise SettingsError(f"cannot fit a lens for {model_dir}: {err}", hint="pass more --conversations") from None
    save_translators(report.translators, target, what)
    console = Console(highlight=False)
    console.print(render_agreement(report.raw, report.tuned, report.eval_positions))
    console.print(f"saved the tuned lens (rank {report.rank}) to {target}", soft_wrap=True)


def held_out_conversations(engine, model_dir: Path, count: int, log=lambda line: None) -> list:
    """Chat to fit a lens on, two kinds interleaved (so the fit's half and the measured half hold both): the held-out
    conversations of the recipe that made the model (else the default model's recipe's held-out tool exchanges),
    and the model's own greedy answers to general prompts, the text a chat shows most. Tool exchanges alone fit a
    lens that reads general text worse than the raw one. A model whose chat template has no tool markers (a
    converted GGUF) cannot be shown a tool call: it is fitted on its own answers alone, and `log` says so."""
    import random

    from chatapp.errors import ModelDirError
    from chatapp.recipes.heldout import held_out_for
    from chatapp.recipes.smollm2.data import general_prompts
    from chatapp.recipes.smollm2.evaluate import held_out_chat
    from chatapp.settings import GenerationSettings

    tools = count // 2 if getattr(engine.chat_format, "tool_markers", None) is not None else 0
    if tools == 0:
        log("the model's chat template has no tool markers: fitting on its answers to general prompts only")
    try:
        recipe = held_out_for(model_dir).conversations(tools)[:tools] if tools else []
    except ModelDirError:
        recipe = held_out_chat([], tools)
    prompts = general_prompts(random.Random(GENERAL_SEED), count - tools)
    replies = engine.generate_batch(prompts, GenerationSettings(max_tokens=GENERAL_TOKENS))
    general = [
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply.content}]
        for prompt, reply in zip(prompts, replies, strict=True)
    ]
    mixed = [chat for pair in zip(general, recipe, strict=False) for chat in pair]
    return mixed + general[len(recipe) :] + recipe[len(general) :]


def render_agreement(raw: list[float], tuned: list[float] | None, positions: int) -> Group:
    """Per layer: the share of held-out positions where the lens's top token is the model's, raw (and tuned)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    title = Text(f"top-1 agreement with the model's output on {positions} held-out positions", style="dim")
    table = Table(box=None, pad_edge=False, header_style="dim")
    for name in ("layer", "raw", *(("tuned",) if tuned else ())):
        table.add_column(name, justify="right")
    for layer, share in enumerate(raw):
        table.add_row(str(layer), f"{share:.1%}", *((f"{tuned[layer]:.1%}",) if tuned else ()))
    return Group(title, table)
