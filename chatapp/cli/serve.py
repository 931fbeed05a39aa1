"""`chatapp serve`: its options, handed to `chatapp/serve/command.py`, which builds the server over the loaded
engine; `table.py` registers the command. uvicorn and Starlette are imported inside the command only."""

from __future__ import annotations

from typing import Annotated

import typer

import chatapp.cli.options as opt


def serve(
    host: Annotated[
        str, typer.Option("--host", help="Address to listen on (localhost only by default; 0.0.0.0 for every one).")
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port (0: any free one).")] = 8000,
    model: opt.ModelOption = None,
    api_key: opt.ApiKeyOption = None,
    device: opt.DeviceOption = None,
    dtype: opt.DtypeOption = None,
    routing: opt.RoutingOption = None,
    max_rows: Annotated[
        int, typer.Option("--max-rows", min=1, max=1024, help="Rows decoded together at most (one per choice).")
    ] = 32,
    max_queue: Annotated[
        int, typer.Option("--max-queue", min=0, help="Requests that may wait for a row; past it they get 429.")
    ] = 64,
    timeout: Annotated[
        float, typer.Option("--timeout", min=1.0, help="Seconds a request may take, queue included (then 408).")
    ] = 600.0,
    log_level: Annotated[
        str, typer.Option("--log-level", help="uvicorn's log level: warning (default), info (with each request)...")
    ] = "warning",
) -> None:
    """Serve the model over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models), requests batched
    together between decode steps. SIGTERM or Ctrl-C finishes replies in flight (10 s at most) and exits 0."""
    from chatapp.lifecycle import starting_up
    from chatapp.models.registry import default_model_name
    from chatapp.serve.client import check_api_key

    check_api_key(api_key)

    with starting_up():
        from chatapp.models import load_engine
        from chatapp.serve.app import ServeConfig
        from chatapp.serve.command import build_server

        engine = load_engine(model, device, dtype=dtype)
    level = engine.resolve_level(routing)
    config = ServeConfig(
        model_id=served_name(model or default_model_name()),
        api_key=api_key,
        routing_level=level,
        request_timeout=timeout,
    )
    server = build_server(
        engine, config, host=host, port=port, max_rows=max_rows, max_queue=max_queue, log_level=log_level
    )
    server.run()
    if not server.started:  # the address could not be bound: uvicorn said why
        raise typer.Exit(1)


def served_name(model: str) -> str:
    """The id `/v1/models` lists: a registered name as it is, a directory by its last part."""
    from pathlib import Path

    return Path(model).name or model
