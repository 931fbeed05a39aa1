"""The `chatapp` command line: the table of its commands (Typer).

The commands that run a model's replies (`run`, `generate`) and `calc` are here; the others live in their own
modules with their options and what they do (the other modules of `chatapp/cli/`; `batch` in `batch.py`, in front
of `chatapp/batch/command.py`) and are registered below. Heavy imports (torch, transformers, textual, the trainers)
happen inside the commands so `chatapp --help` stays instant. User-caused errors are `ChatappError`s: printed as one
clear message on stderr, exit code 1, no traceback (`chatapp/cli/errors.py`).
"""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn

import typer
from rich.console import Console

import chatapp.cli.options as opt
from chatapp import __version__
from chatapp.cli.batch import batch
from chatapp.cli.convert import convert
from chatapp.cli.errors import ChatappGroup, StdoutError, StdoutPipeError, err_console, guard_stdout, stdout_failed
from chatapp.cli.eval import eval_model
from chatapp.cli.info import info, models
from chatapp.cli.lens import lens_app
from chatapp.cli.options import (
    ApiKeyOption,
    CompileOption,
    DeviceOption,
    DtypeOption,
    LogprobsOption,
    MaxTokensOption,
    ModelOption,
    ProgramOption,
    RoutingOption,
    SeedOption,
    ServerOption,
)
from chatapp.cli.program import program_app
from chatapp.cli.prompt_input import read_json_schema, read_prompt
from chatapp.cli.route import route
from chatapp.cli.serve import serve
from chatapp.cli.train import train
from chatapp.errors import SettingsError

app = typer.Typer(
    name="chatapp",
    help="Watch a small language model think: sampled vs forced tokens, TTFA zones, STT routing, inline tools.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=ChatappGroup,
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"chatapp {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit.", callback=_version_callback, is_eager=True)
    ] = False,
) -> None:
    """chatapp: a terminal tool for watching a language model think while it talks."""
    from chatapp.settings import clean_data_dir

    clean_data_dir()  # staging that a killed process left in the data directory (never fails)


app.command()(info)  # chatapp/cli/info.py
app.command()(models)


@app.command()
def calc(
    expression: Annotated[
        str,
        typer.Argument(help='Arithmetic such as "37*45" or \'"strawberry".count("r")\'; put -- before a leading -.'),
    ],
) -> None:
    """Evaluate an expression with the model's inline calculator (same rules, same output text)."""
    from chatapp.errors import ToolError
    from chatapp.tools import CALCULATOR

    result = CALCULATOR.run(expression)
    if not result.ok:
        shown = expression if len(expression) <= 80 else expression[:77] + "..."
        err = ToolError(
            f"the calculator refused {shown!r}: {result.reason}",
            hint='use numbers, + - * / // %, parentheses and "text".count("x")',
        )
        raise err
    typer.echo(result.text)


app.add_typer(lens_app, name="lens")  # `chatapp lens "PROMPT"`, `chatapp lens fit MODEL` (chatapp/cli/lens.py)

app.add_typer(program_app, name="program")  # chatapp/cli/program.py


@app.command()
def run(
    model: ModelOption = None,
    program: ProgramOption = None,
    db: Annotated[
        str | None, typer.Option("--db", help="Chat history database (default: history.sqlite3 in the data dir).")
    ] = None,
    device: DeviceOption = None,
    in_process: Annotated[
        bool,
        typer.Option(
            "--in-process",
            help="Run the model in the UI's process instead of its own engine process (slower while drawing).",
        ),
    ] = False,
    routing: RoutingOption = None,
    server: ServerOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Open the chat TUI: streamed tokens (sampled vs forced), zone tags, routing heatmap, tool calls, history.
    With --server, a running `chatapp serve` answers, and the TUI shows the same from its stream."""
    from pathlib import Path

    from chatapp.models.loader import check_environment, check_model_dir, resolve_device
    from chatapp.models.registry import is_registered, resolve_model
    from chatapp.routing_levels import config_level
    from chatapp.ttfa.loader import load_program_source_by_name
    from chatapp.ui.terminal import end_on_hangup, keys_held_for_the_app

    if server is not None:
        local_only = {"--model": model, "--program": program, "--device": device, "--routing": routing,
                      "--in-process": in_process or None}
        if given := [name for name, value in local_only.items() if value is not None]:
            raise SettingsError(
                f"{', '.join(given)} cannot be used with --server (the server's model runs as it was started)",
                hint=f"drop {', '.join(given)}, or run without --server",
            )
    # What the user types from now on is the app's, even before the app has the terminal (keys_held_for_the_app).
    with keys_held_for_the_app():
        # Every value the user typed is checked here, before seconds of model loading in the engine process (whose
        # errors would otherwise arrive only after it): the program file is read and parsed (compiling it needs
        # the tokenizer, so that part is the engine's, and its error comes back as this one does), the device is
        # resolved, the model directory is looked at; first the environment's settings.
        check_environment()
        backend = None
        if server is not None:
            from chatapp.ui.remote import ServerBackend

            backend = ServerBackend(server, api_key=api_key)  # asks the server for its model: refused here if down
        else:
            if program is not None:
                load_program_source_by_name(program)
            if device is not None:
                resolve_device(device)
            if is_registered(model):  # here, not in the engine process: the first use prepares the model (a bar)
                model = str(resolve_model(model))
            config = check_model_dir(resolve_model(model))
            if routing is not None:  # else the whole TUI is drawn before the engine process refuses it
                config_level(config, routing)
            if not in_process:
                from chatapp.ui.process import start_engine

                # Started before the app's modules are imported (Textual, ~0.5 s): the first answer waits for the
                # engine process's model, and the two processes load side by side.
                backend = start_engine(model, device=device, program=program, routing_level=routing)
                program = None  # the engine process switches to it as it starts
        try:
            from chatapp.ui.app import close_backend, make_app

            chat = make_app(
                model_dir=model,
                program=program,
                db_path=Path(db).expanduser() if db else None,
                device=device,
                in_process=in_process,
                backend=backend,
                routing_level=routing if in_process else None,
            )
        except BaseException:
            if backend is not None:
                backend.close()
            raise
        if getattr(chat.store, "notice", None):
            err_console.print(f"notice: {chat.store.notice}", markup=False, soft_wrap=True)
        end_on_hangup()
        try:
            chat.run()
        finally:
            close_backend(chat.backend)
    if chat.engine_error is not None:  # the model did not load: the app closed so that this can be printed
        if chat.unsent:
            err_console.print(f"not sent (the model did not load): {chat.unsent}", markup=False, soft_wrap=True)
        raise chat.engine_error
    if chat.return_code:  # the app stopped on an error it showed (a bug: user errors are notifications)
        raise typer.Exit(chat.return_code)


@app.command()
def generate(
    prompt: Annotated[
        str, typer.Argument(help="The prompt to answer, sent as one user turn; - reads it from stdin (any length).")
    ],
    model: ModelOption = None,
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
    max_tokens: MaxTokensOption = 256,
    seed: SeedOption = 0,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    compile: CompileOption = None,
    program: ProgramOption = None,
    regex: Annotated[
        str | None, typer.Option("--regex", help="Constrain the reply to match this regular expression.")
    ] = None,
    json_schema: Annotated[
        str | None,
        typer.Option(
            "--json-schema", help="Constrain the reply to JSON matching this schema (inline JSON or a .json file)."
        ),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Print timing: tokens/s, forced %, ...")] = False,
    logprobs: LogprobsOption = 0,
    routing: RoutingOption = None,
    server: ServerOption = None,
    api_key: ApiKeyOption = None,
) -> None:
    """Stream a reply to PROMPT: sampled tokens plain, forced tokens (tool output) in italic cyan. Into a pipe or
    a file it writes exactly the reply's text (timing and errors go to stderr). With --server, a running `chatapp
    serve` answers (no model is loaded here)."""
    from chatapp.lifecycle import starting_up
    from chatapp.settings import GenerationSettings, setting_sources
    from chatapp.validation import check_prompt_fits, check_prompt_text

    chosen = opt.chosen_sampling(locals())
    settings = GenerationSettings(max_tokens=max_tokens, seed=seed, logprobs=logprobs).with_(**chosen)
    if regex is not None and json_schema is not None:
        raise SettingsError("--regex and --json-schema both constrain the reply", hint="pass one of them")
    schema = read_json_schema(json_schema) if json_schema is not None else None
    prompt = read_prompt() if prompt == "-" else prompt
    check_prompt_text(prompt)
    if server is not None:
        local_only = {"--device": device, "--dtype": dtype, "--compile": compile, "--program": program,
                      "--regex": regex, "--logprobs": logprobs or None, "--routing": routing}
        if given := [name for name, value in local_only.items() if value is not None]:
            raise SettingsError(
                f"{', '.join(given)} cannot be used with --server (the server's model runs as it was started)",
                hint=f"drop {', '.join(given)}, or run without --server",
            )
        from chatapp.cli.remote import generate_remote

        exact = None if sys.stdout.isatty() else sys.stdout
        console = Console(highlight=False) if exact is None else err_console
        generate_remote(
            server, prompt, settings, console, sampling=chosen, model=model, json_schema=schema, api_key=api_key,
            exact=exact, verbose=verbose,
        )
        return
    with starting_up():
        from chatapp.cli.render import stream_reply  # torch
        from chatapp.models import load_engine

        engine = load_engine(model, device, dtype=dtype, compile=compile)
    settings = engine.default_settings(settings, chosen).with_(routing_level=engine.resolve_level(routing))
    check_prompt_fits(len(prompt), int(engine.context_size), engine.tokenizer)
    compiled = None
    if program is not None:
        from chatapp.ttfa import load_program

        compiled = load_program(program, engine.tokenizer, engine.chat_format.program_aliases)
    constraint = engine.constraint(regex=regex, json_schema=schema) if regex or schema is not None else None
    if compiled is not None and constraint is not None:
        from chatapp.engine.constraints import check_forced_start

        option = "--regex" if regex is not None else "--json-schema"
        check_forced_start(
            compiled,
            constraint,
            program_name=f"--program {program}",
            constraint_name=f"--regex {regex!r}" if regex is not None else "--json-schema",
            drop=f"--program or {option}",
        )
    exact = None if sys.stdout.isatty() else sys.stdout
    console = Console(highlight=False) if exact is None else err_console
    reply = stream_reply(
        engine,
        prompt,
        settings,
        console,
        exact=exact,
        verbose=verbose,
        program=compiled,
        constraint=constraint,
        sources=setting_sources(engine.sampling_defaults, chosen),
    )
    if reply.finish_reason == "error":  # the row could not go on (its message is printed): not a success
        raise typer.Exit(1)


app.command()(batch)  # chatapp/cli/batch.py: the front of chatapp/batch/
app.command()(serve)  # chatapp/cli/serve.py: the front of chatapp/serve/


# The commands that build or measure a model, each in its module with its options (chatapp/cli/).
app.command()(convert)
app.command()(train)
app.command()(route)
app.command(name="eval")(eval_model)


def main() -> NoReturn:
    """Console-script entry point. The process ends through `lifecycle.exit_process` (exit-time work, then
    `os._exit`), ~0.6 s sooner than Python's own finalization once a model was loaded."""
    from chatapp.lifecycle import exit_process

    code: object = 0
    guard_stdout()  # a broken stdout, whichever command finds it, is one error line (`errors.StdoutError`)
    try:
        try:
            app()
        except SystemExit as done:
            code = done.code
        sys.stdout.flush()  # here, not in the exit's flush, so that output a full disk refused is reported
    except KeyboardInterrupt:
        err_console.print("interrupted")
        code = 130
    except StdoutError as err:
        code = stdout_failed(err)
    except BrokenPipeError as err:  # from a writer that bypassed `sys.stdout` (its file descriptor): as above
        code = stdout_failed(StdoutPipeError(err))
    exit_process(code)
