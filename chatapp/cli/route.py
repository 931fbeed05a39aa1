"""`chatapp route MODEL`: fit a model's STT routing (`chatapp.training.route`) and write the routed model.

The fit has the model answer a set of prompts: the set its recipe registered with it (`chatapp.models.route_prompts`)
or the user's own `--prompts FILE.jsonl`. This command reads prompts as data and never imports a recipe: any model
directory routes the same way, and a model no recipe made (a converted GGUF) only needs a prompts file.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from chatapp.errors import TrainingError

if TYPE_CHECKING:
    from chatapp.training.corpus import Dialogue

err_console = Console(stderr=True, highlight=False)
MIN_CONVERSATIONS = 8  # a quarter is held out to calibrate on: fewer leaves too little to measure
MAX_CONVERSATIONS = 4096  # every conversation's layer inputs are cached for the fit: bounded memory


def _layer_list(value: str | None) -> list[int] | None:
    """`--layers`: a comma-separated list of layer indices, or None (whether each exists is `RouteOptions.check`)."""
    if value is None:
        return None
    try:
        return list(dict.fromkeys(int(part) for part in value.split(",") if part.strip()))
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of layer numbers (e.g. 3,4,5)") from None


def route_dialogues(model: str, model_dir: Path, prompts: str | None, count: int, seed: int) -> list[Dialogue]:
    """The conversations the fit has the model answer: `count` of the `--prompts` file's, else of the set the
    model's recipe registered, drawn by `seed` (all of them when the set is smaller); `TrainingError` when there is
    no set, or it is too small to hold a quarter out."""
    return [turns for _, turns in route_dialogue_lines(model, model_dir, prompts, count, seed)]


def route_dialogue_lines(
    model: str, model_dir: Path, prompts: str | None, count: int, seed: int
) -> list[tuple[str, Dialogue]]:
    """`route_dialogues`, each with where it is (`FILE:LINE`)."""
    from chatapp.models.route_prompts import drawn, route_prompts_file
    from chatapp.training.corpus import read_dialogue_lines

    example = f"chatapp route {model} --prompts prompts.jsonl"
    if prompts is not None:
        source, dialogues = prompts, read_dialogue_lines(prompts)
    elif (registered := route_prompts_file(model_dir)) is not None:
        source, dialogues = str(registered), read_dialogue_lines(registered, "prompt set")
    else:
        raise TrainingError(
            f"{model_dir} has no prompt set of its own to fit routing on (no chatapp recipe made it)",
            hint=f'pass conversations to fit on: `{example}`, one {{"messages": [...]}} per line (the user turns '
            "are asked; the model writes the replies)",
        )
    if len(dialogues) < MIN_CONVERSATIONS:
        raise TrainingError(
            f"{source} holds {len(dialogues)} conversations; a routing fit needs at least {MIN_CONVERSATIONS} "
            "(a quarter is held out to calibrate on)",
            hint=f"add conversations to {source}",
        )
    return drawn(dialogues, count, seed)


def check_dialogues_fit(dialogues: list[tuple[str, Dialogue]], chat_format, context: int) -> None:
    """`ContextOverflowError` naming the file and line of a conversation whose user turns alone (the model's replies
    left out) leave no room in the model's context for a reply: checked before the fit, which would otherwise stop
    at it after minutes with only its place in the drawn set."""
    from chatapp.errors import ContextOverflowError

    for where, turns in dialogues:
        messages: list[dict[str, str]] = []
        for turn in turns:
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
        needed = len(chat_format.render_for_completion(messages[:-1]))
        if needed >= context:
            raise ContextOverflowError(
                f"{where}: the conversation's user turns are {needed} tokens, and the model's context holds {context}"
                ", with no room left for the replies",
                hint=f"shorten or remove the conversation at {where}",
            )


def route(
    model: Annotated[str, typer.Argument(help="The model to route: a name (default, tiny) or a model directory.")],
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            help="Write the routed model here: a new or empty directory, or one chatapp wrote (default: a new routed "
            "copy MODEL-routed in the data directory, listed by `chatapp models`).",
        ),
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option(
            "--layers",
            help="Candidate layers, cheapest first, e.g. 4,6,3 (default: chosen by measuring each layer alone).",
        ),
    ] = None,
    max_layers: Annotated[int, typer.Option("--max-layers", min=1, help="At most this many routed layers.")] = 12,
    skip_mode: Annotated[
        str,
        typer.Option(
            "--skip-mode",
            help="kv: a skipped token still writes its K/V; predict: K/V plus a fitted predicted update; "
            "strict: the spec's mode.",
        ),
    ] = "kv",
    budget: Annotated[
        float, typer.Option("--budget", min=1.0, help="Held-out perplexity allowed, routed / routing off.")
    ] = 1.10,
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            metavar="FILE.jsonl",
            help='Conversations the model answers to fit and measure on: one {"messages": [...]} per line, as '
            "`chatapp train` reads (the user turns are asked; the model writes the replies). Default: the set the "
            "model's recipe ships with it; needed for a model without one (e.g. one `chatapp convert` wrote).",
        ),
    ] = None,
    conversations: Annotated[
        int,
        typer.Option(
            "--conversations",
            min=MIN_CONVERSATIONS,
            max=MAX_CONVERSATIONS,
            help="How many of the prompt set's conversations to use, drawn by --seed (all when it holds fewer).",
        ),
    ] = 96,
    answer_tokens: Annotated[int, typer.Option("--answer-tokens", min=8, help="Tokens per reply.")] = 128,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the conversations drawn and of the fit.")] = 0,
    tune_steps: Annotated[
        int,
        typer.Option(
            "--tune-steps",
            min=0,
            help="Fine-tune the model (LoRA) this many steps to tolerate its routing before the routers are fitted "
            "again and calibrated (~10 s a step on 2 CPU cores; resumable). 0: the weights stay frozen.",
        ),
    ] = 0,
    tune_device: Annotated[
        str,
        typer.Option(
            "--tune-device",
            help="Where the fine-tune's steps run: cpu, or cuda (a GPU: seconds a step become a fraction of one; the "
            "rest of the fit stays on the CPU).",
        ),
    ] = "cpu",
    dense_prompts: Annotated[
        bool | None,
        typer.Option(
            "--dense-prompts/--routed-prompts",
            help="Prompts through every layer and only the replies routed (fitted, calibrated and tuned on the "
            "replies' tokens), or every token routed. Default: as the model's config says (route_prompt).",
        ),
    ] = None,
) -> None:
    """Fit the STT routing of a model and calibrate one cutoff per layer on held-out perplexity and a copy probe
    (minutes on a CPU, the weights frozen; --tune-steps fine-tunes them to the routing too). Works on any model
    directory, e.g. one `chatapp convert` wrote; the model itself is never rewritten unless --out names it."""
    from dataclasses import replace

    from chatapp.models import load_model, resolve_model
    from chatapp.models.loader import check_model_dir
    from chatapp.models.registry import check_model_output, new_routed_copy
    from chatapp.settings import data_dir, locks_dir
    from chatapp.training.route import RouteOptions, write_routed
    from chatapp.training.route import route as fit_routing
    from chatapp.training.tune import TuneOptions

    # Every option, the model directory, the prompts and the output are checked before the model loads (and the
    # fit's minutes).
    options = RouteOptions(
        layers=_layer_list(layers),
        max_layers=max_layers,
        skip_mode=skip_mode,
        budget=budget,
        answer_tokens=answer_tokens,
        seed=seed,
        tune=TuneOptions(steps=tune_steps, device=tune_device),
        dense_prompts=dense_prompts,
    )
    source = resolve_model(model)
    config = check_model_dir(source)
    layer_count, context = config.get("num_hidden_layers"), config.get("max_position_embeddings")
    if isinstance(layer_count, int) and isinstance(context, int):  # else loading names what is wrong with it
        options.check(layer_count, context)
    target = Path(out).expanduser() if out is not None else new_routed_copy(model, source)
    check_model_output(target, "--out directory" if out is not None else "routed copy")
    dialogues = route_dialogue_lines(model, source, prompts, conversations, seed)
    options = replace(options, dialogues=[turns for _, turns in dialogues])
    locks = locks_dir()

    loaded = load_model(source, dtype="float32")  # the fit reads the model's own activations, not a lossy format's
    check_dialogues_fit(dialogues, loaded.chat_format, int(loaded.model.config.max_position_embeddings))
    log = lambda line: err_console.print(f"[dim]{line}[/dim]")  # noqa: E731
    # The replies the fit learns from are written by the model as it is served (its default format).
    speaker = load_model(source)
    routed = fit_routing(loaded, options, log, cache_dir=data_dir() / "routing-data", speaker=speaker)
    write_routed(routed, source, target, locks)
    if routed.checkpoint is not None:  # only a run that did not finish resumes from it; 4.5 MB each for tiny
        with contextlib.suppress(OSError):  # the model is written: a checkpoint left behind costs only space
            routed.checkpoint.unlink(missing_ok=True)
    typer.echo(f"{routed.report.summary()}\nwrote {target}")
    if out is None:
        typer.echo(f"a routed copy of {model}: run it with --model {target.name} (`chatapp models` lists it)")
