"""`chatapp batch`: its options and their defaults, handed to `chatapp/batch/command.py`, which reads the requests,
loads the model, runs the batches and writes the records; `table.py` registers the command."""

from __future__ import annotations

from typing import Annotated

import typer

import chatapp.cli.options as opt
from chatapp.cli.errors import err_console


def batch(
    input: Annotated[str, typer.Argument(help="A .jsonl file of requests, or - for stdin.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Where records go (- = stdout, the default).")] = "-",
    model: opt.ModelOption = None,
    device: opt.DeviceOption = None,
    dtype: opt.DtypeOption = None,
    compile: opt.CompileOption = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Rows per device batch.")] = 32,
    samples: Annotated[int, typer.Option("--samples", min=1, max=1024, help="Samples per line that sets none.")] = 1,
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
    max_tokens: opt.MaxTokensOption = 256,
    seed: opt.SeedOption = 0,
    program: Annotated[
        str | None,
        typer.Option("--program", help="TTFA program (chat, think, calc, json or a .toml) for lines that name none."),
    ] = None,
    ordered: Annotated[bool, typer.Option("--ordered", help="Write records in input order.")] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Keep the (id, sample) records already in --output, add the rest.")
    ] = False,
    fsync: Annotated[bool, typer.Option("--fsync", help="fsync every record (survives power loss).")] = False,
    logprobs: opt.LogprobsOption = 0,
    routing: opt.RoutingOption = None,
) -> None:
    """Generate every line of a JSONL file in device batches: one JSON record per (id, sample), an error record per
    bad line (exit code 1 if any), a summary on stderr. The sampling options are the defaults a line may override;
    an option left out takes the model's own default (its generation_config.json)."""
    from chatapp.batch.command import run_batch_command
    from chatapp.batch.requests import BatchDefaults
    from chatapp.batch.runner import BatchOptions
    from chatapp.settings import GenerationSettings

    chosen = opt.chosen_sampling(locals())
    settings = GenerationSettings(max_tokens=max_tokens, seed=seed, logprobs=logprobs, routing_level=routing)
    settings = settings.with_(**chosen)
    summary = run_batch_command(
        input,
        output=output,
        model=model,
        device=device,
        dtype=dtype,
        compile=compile,
        defaults=BatchDefaults(settings=settings, chosen=frozenset(chosen), samples=samples, program=program),
        options=BatchOptions(batch_size=batch_size, ordered=ordered),
        resume=resume,
        fsync=fsync,
        console=err_console,
    )
    raise typer.Exit(summary.exit_code)
