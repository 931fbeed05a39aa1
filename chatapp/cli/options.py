"""Command-line options more than one command module of the package takes (`table.py`, `lens.py`, `eval.py`,
`train.py`), typed once."""

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
