"""Command-line options more than one command takes (`table.py`'s `run` and `generate`, `batch.py`, `lens.py`,
`eval.py`, `train.py`), typed once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import typer

ModelOption = Annotated[
    str | None,
    typer.Option("--model", help="A model name (tiny) or a model directory (default: the default model)."),
]
DeviceOption = Annotated[str | None, typer.Option("--device", help="cpu, cuda, cuda:N or auto (default).")]
DtypeOption = Annotated[
    str | None,
    typer.Option("--dtype", help="Weight format: auto (default; $CHATAPP_DTYPE), float32, bfloat16, int8 or int4."),
]
CompileOption = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="CUDA: compile the decode step (torch.compile) before the first token. On a CPU the step is one "
        "native call (int8) or eager, never compiled. Default: $CHATAPP_COMPILE, else no.",
    ),
]
ProgramOption = Annotated[
    str | None,
    typer.Option("--program", help="TTFA program: a built-in name (chat, think, calc, json) or a .toml file."),
]
# Sampling: an option left out takes the model's own default (its generation_config.json), else chatapp's built-in
# one (greedy, every other sampler off); docs/usage.md gives each one's semantics and the default model's values.
_MODEL_DEFAULT = "Default: the model's, else"
TemperatureOption = Annotated[
    float | None, typer.Option("--temperature", help=f"0 = greedy. {_MODEL_DEFAULT} 0.", show_default=False)
]
TopKOption = Annotated[
    int | None, typer.Option("--top-k", help=f"Keep the k most likely tokens. {_MODEL_DEFAULT} 0 (off).")
]
TopPOption = Annotated[float | None, typer.Option("--top-p", help=f"Nucleus sampling mass. {_MODEL_DEFAULT} 1 (off).")]
MinPOption = Annotated[
    float | None,
    typer.Option("--min-p", help=f"Drop tokens less likely than min-p x the likeliest. {_MODEL_DEFAULT} 0 (off)."),
]
RepetitionPenaltyOption = Annotated[
    float | None,
    typer.Option(
        "--repetition-penalty",
        help=f"Divide a recent token's positive logit (multiply a negative one) by this. {_MODEL_DEFAULT} 1 (off).",
    ),
]
PresencePenaltyOption = Annotated[
    float | None,
    typer.Option("--presence-penalty", help=f"Subtract from a recent token's logit (-2..2). {_MODEL_DEFAULT} 0."),
]
FrequencyPenaltyOption = Annotated[
    float | None,
    typer.Option(
        "--frequency-penalty", help=f"Subtract this x a token's recent count from its logit (-2..2). {_MODEL_DEFAULT} 0."
    ),
]
RepeatLastNOption = Annotated[
    int | None,
    typer.Option(
        "--repeat-last-n",
        help=f"The three penalties' window in tokens (-1 = the whole reply, 0 = none). {_MODEL_DEFAULT} 64.",
    ),
]
DryMultiplierOption = Annotated[
    float | None,
    typer.Option("--dry-multiplier", help=f"DRY's penalty on extending a repeat. {_MODEL_DEFAULT} 0 (off)."),
]
DryBaseOption = Annotated[
    float | None, typer.Option("--dry-base", help=f"DRY's growth per repeated token. {_MODEL_DEFAULT} 1.75.")
]
DryAllowedLengthOption = Annotated[
    int | None,
    typer.Option("--dry-allowed-length", help=f"The longest repeat DRY leaves alone. {_MODEL_DEFAULT} 2."),
]
DryPenaltyLastNOption = Annotated[
    int | None,
    typer.Option(
        "--dry-penalty-last-n", help=f"DRY's window in tokens (-1 = the whole reply). {_MODEL_DEFAULT} -1."
    ),
]
DrySequenceBreakersOption = Annotated[
    str | None,
    typer.Option(
        "--dry-sequence-breakers",
        help=f'A JSON list of strings no repeat extends across. {_MODEL_DEFAULT} \'["\\n", ":", "\\"", "*"]\'.',
    ),
]
MaxTokensOption = Annotated[int, typer.Option("--max-tokens", help="Most sampled tokens (forced ones are free).")]
SeedOption = Annotated[int, typer.Option("--seed", help="Random seed for sampling.")]
RoutingOption = Annotated[
    str | None,
    typer.Option(
        "--routing",
        metavar="LEVEL",
        help="STT routing level: off, or one the model names, e.g. quality or fast (default: the model's first; "
        "chatapp models lists them).",
    ),
]
LogprobsOption = Annotated[
    int, typer.Option("--logprobs", help="Per token: log-probability, entropy and N alternatives (0-20; 0 = off).")
]
ServerOption = Annotated[
    str | None,
    typer.Option(
        "--server",
        envvar="CHATAPP_SERVER",
        help="Use a running `chatapp serve` at this URL instead of loading a model.",
    ),
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="CHATAPP_API_KEY",
        help="The API key: `serve` requires it of every request; `--server` sends it.",
    ),
]


def chosen_sampling(options: Mapping[str, object]) -> dict[str, object]:
    """The sampling options the user set, picked by name from a command's `options` (its `locals()`: every
    command declares the same sampling options, `SAMPLING_FIELDS`; one not set is None, and the model's defaults
    decide it), checked at once, so that a bad value is refused before the model loads. `dry_sequence_breakers`
    arrives as its option's JSON text."""
    from chatapp.settings import SAMPLING_FIELDS, GenerationSettings

    chosen = {name: options[name] for name in SAMPLING_FIELDS if options.get(name) is not None}
    if "dry_sequence_breakers" in chosen:
        chosen["dry_sequence_breakers"] = _breakers(str(chosen["dry_sequence_breakers"]))
    GenerationSettings().with_(**chosen)
    return chosen


def _breakers(text: str) -> tuple[str, ...]:
    import json

    from chatapp.errors import SettingsError

    hint = 'write a JSON list of strings, e.g. --dry-sequence-breakers \'["\\n", ":"]\' (or \'[]\' for none)'
    try:
        value = json.loads(text)
    except ValueError:
        raise SettingsError(f"--dry-sequence-breakers {text!r} is not JSON", hint=hint) from None
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise SettingsError(f"--dry-sequence-breakers {text!r} is not a list of non-empty strings", hint=hint)
    return tuple(value)
