"""Command-line options more than one command takes (`table.py`'s `run` and `generate`, `batch.py`, `lens.py`,
`eval.py`, `train.py`), typed once."""

from __future__ import annotations

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
TemperatureOption = Annotated[float, typer.Option("--temperature", help="0 = greedy.")]
TopKOption = Annotated[int, typer.Option("--top-k", help="Keep the k most likely tokens (0 = off).")]
TopPOption = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass (1.0 = off).")]
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
