"""The `chatapp` command line: one Typer command per function.

Heavy imports (torch, transformers, textual) happen inside the commands so `chatapp --help` stays instant.
User-caused errors are `ChatappError`s: printed as one clear message on stderr, exit code 1, no traceback.
"""

from __future__ import annotations

import os
import sys
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from chatapp import __version__
from chatapp.cli_options import DeviceOption, DtypeOption, ModelOption
from chatapp.errors import ChatappError, ModelDirError, SettingsError, user_message
from chatapp.lens_command import lens_app

# The Click that parses: typer 0.2x's own copy, Click itself before it (importing Click beside typer's copy would
# cost `chatapp --help` a tenth of its time for exceptions that are never raised).
try:
    from typer._click import Context
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover
    from click import Context
    from click import exceptions as click_errors
_USAGE_ERRORS = (click_errors.UsageError,)
_NO_ARGS_IS_HELP = tuple(kind for kind in (getattr(click_errors, "NoArgsIsHelpError", None),) if kind)
_NO_SUCH_OPTION = (click_errors.NoSuchOption,)


class ChatappGroup(TyperGroup):
    """The command group: a `ChatappError` from any command, and a usage error (a bad option value, an unknown
    option), is printed as one message (no traceback, no usage box) and exits with its code (1), so commands just
    raise. `user_error` is the one place that turns an exception into that message and its fix."""

    def make_context(self, info_name: str | None, args: list[str], parent=None, **extra: Any) -> Context:
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except _USAGE_ERRORS as err:
            if isinstance(err, _NO_ARGS_IS_HELP):
                raise
            raise fail(user_error(err)) from None

    def invoke(self, ctx: Context) -> Any:
        words = [*getattr(ctx, "_protected_args", ()), *ctx.args]  # before the group consumes them
        try:
            return super().invoke(ctx)
        except (ChatappError, *_USAGE_ERRORS) as err:
            if isinstance(err, _NO_ARGS_IS_HELP):
                raise
            raise fail(user_error(err, command=self._command_named(ctx, words))) from None

    def _command_named(self, ctx: Context, words: list[str]) -> str:
        """The command path `words` name (`chatapp program show`): Click raises some usage errors (an option
        without its value) without the context that knows it."""
        path, command = [ctx.command_path], self
        for word in words:
            sub = command.get_command(ctx, word) if hasattr(command, "get_command") else None
            if sub is None:
                break
            path.append(word)
            command = sub
        return " ".join(path)


def user_error(err: Exception, *, command: str = "chatapp") -> ChatappError:
    """The message and fix for an exception a user caused: a `ChatappError` as it is, a Click usage error as a
    `SettingsError` (one line and the --help of its command, or of `command` when Click did not say which, where
    Click would print its usage box and exit 2)."""
    if isinstance(err, ChatappError):
        return err
    if isinstance(err, _NO_SUCH_OPTION) and not err.option_name.startswith("--"):
        hint = "an argument that starts with '-' goes after --, e.g. `chatapp calc -- '-5+3'`"
    else:
        command = err.ctx.command_path if getattr(err, "ctx", None) is not None else command
        hint = f"see `{command} --help`"
    usage = SettingsError(err.format_message(), hint=hint)
    usage.exit_code = 1
    return usage


app = typer.Typer(
    name="chatapp",
    help="Watch a small language model think: sampled vs forced tokens, TTFA zones, STT routing, inline tools.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=ChatappGroup,
)
err_console = Console(stderr=True, highlight=False)


def fail(err: ChatappError) -> typer.Exit:
    """Print a user-caused error as its `error:` line and its `fix:` line, and return the Exit to raise."""
    shown = user_message(err)
    # Messages quote user input (expressions, paths) that may contain "[...]": escape it so Rich prints it as-is.
    err_console.print(f"[bold red]error:[/] {escape(shown.error)}", markup=True, soft_wrap=True)
    err_console.print(f"[bold]fix:[/] {escape(shown.fix)}", markup=True, soft_wrap=True)
    return typer.Exit(code=err.exit_code)


# Options several commands share, typed once.
CompileOption = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="Use the compiled decode step before the first token: the one saved for this machine, or compile and "
        "save it (needs g++; 20-60 s once; loading a saved one takes ~4 s, for ~1.8x faster decoding). "
        "--no-compile: eager. Default: $CHATAPP_COMPILE, else eager for one reply, a saved step for a batch.",
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


@app.command()
def info() -> None:
    """Show versions, the compute device, and where config, data, history and the default model live."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from chatapp.models.loader import is_complete_model_dir
    from chatapp.models.registry import default_model_name, model_listing
    from chatapp.settings import config_dir, data_dir, data_dir_problem, history_db_path

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} GPU(s))"
    else:
        device = f"cpu ({torch.get_num_threads()} threads)"
    default = next(entry for entry in model_listing() if entry.name == default_model_name())  # nothing is prepared
    from chatapp.stt import cpu_step

    kernel = cpu_step.library_path()  # reported, not built here
    if kernel.is_file():
        kernel_state = f"{kernel} (built)"
    elif problem := cpu_step.compiler_problem():
        kernel_state = f"cannot be built: {problem}; int8 decodes with torch's step"
    else:
        kernel_state = f"{kernel} (not built yet: built at the first int8 load, or by `make kernels`)"
    rows = {
        "chatapp": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": installed("transformers"),
        "textual": installed("textual"),
        "device": device,
        "int8 kernel": kernel_state,
        "config dir": str(config_dir()),
        "data dir": str(data_dir()) + (f" (not usable: {problem})" if (problem := data_dir_problem()) else ""),
        "history db": str(history_db_path()),
        "default model": f"{default.path} ({'present' if is_complete_model_dir(default.path) else 'missing'})",
    }
    for key, value in rows.items():
        typer.echo(f"{key + ':':<15}{value}")


@app.command()
def models() -> None:
    """List the models --model NAME can name: where each lives, its size, context, STT layers and skip mode,
    prepared or not."""
    from rich.table import Table

    from chatapp.models.registry import default_model_name, model_listing

    table = Table(box=None, pad_edge=False)
    for column in ("name", "parameters", "context", "STT layers", "skip mode", "routing levels", "state"):
        table.add_column(column)
    table.add_column("path", overflow="fold")
    for entry in model_listing():
        name = f"{entry.name} (default)" if entry.name == default_model_name() else entry.name
        table.add_row(
            name,
            entry.parameters,
            entry.context,
            entry.stt_layers,
            entry.skip_mode,
            entry.levels,
            entry.state,
            str(entry.path),
        )
    Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200).print(table)


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


app.add_typer(lens_app, name="lens")  # `chatapp lens "PROMPT"`, `chatapp lens fit MODEL` (chatapp/lens_command.py)

program_app = typer.Typer(help="TTFA programs: show a compiled program, check a program file.", no_args_is_help=True)
app.add_typer(program_app, name="program")

TokenizerOption = Annotated[
    str | None,
    typer.Option(
        "--tokenizer",
        help="A tokenizer.json, a model directory or a model name (tiny) to compile for (default: the default "
        "model's).",
    ),
]


def _program_tokenizer(tokenizer: str | None):
    """The tokenizer a program is compiled for (a tokenizer.json, a model directory or name, or the default model's)
    and, for a model directory, its chat format's token-name aliases."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from chatapp.errors import ModelDirError
    from chatapp.models.registry import is_registered, resolve_model

    path = resolve_model(tokenizer) if is_registered(tokenizer) else Path(str(tokenizer)).expanduser()
    model_dir = path if path.is_dir() else None
    if model_dir is not None:
        path = path / "tokenizer.json"
    try:
        loaded = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for missing or malformed files
        raise ModelDirError(
            f"cannot read tokenizer {path}: {err}", hint="pass --tokenizer PATH (a tokenizer.json or a model directory)"
        ) from None
    aliases: dict[str, str] = {}
    if model_dir is not None:
        from chatapp.chat import chat_format_for

        try:
            aliases = chat_format_for(loaded, model_dir).program_aliases
        except ModelDirError:  # no chat format: the program's names are taken as they are
            aliases = {}
    return loaded, aliases


@program_app.command("show")
def program_show(
    program: Annotated[str, typer.Argument(help="A built-in program (chat, think, calc, json) or a .toml file.")],
    tokenizer: TokenizerOption = None,
) -> None:
    """Print a compiled program, one zone per line: feed tokens, triggers, jumps, budgets, tags."""
    from chatapp.ttfa import disassemble, load_program

    vocab, aliases = _program_tokenizer(tokenizer)
    compiled = load_program(program, vocab, aliases)
    typer.echo(disassemble(compiled, vocab))
    for warning in compiled.warnings:
        err_console.print(f"warning: {warning}", markup=False, soft_wrap=True)


@program_app.command("check")
def program_check(
    file: Annotated[str, typer.Argument(help="The .toml program file (or a built-in name) to check.")],
    tokenizer: TokenizerOption = None,
) -> None:
    """Compile a program and report `ok` (plus any warnings), or its first error as FILE:LINE (exit code 1)."""
    from chatapp.ttfa import load_program

    compiled = load_program(file, *_program_tokenizer(tokenizer))
    for warning in compiled.warnings:
        err_console.print(f"warning: {warning}", markup=False, soft_wrap=True)
    typer.echo(f"ok: {compiled.name} ({len(compiled.zones)} zones, {len(compiled.warnings)} warnings)")


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
) -> None:
    """Open the chat TUI: streamed tokens (sampled vs forced), zone tags, routing heatmap, tool calls, history."""
    from pathlib import Path

    from chatapp.models.loader import check_environment, check_model_dir, resolve_device
    from chatapp.models.registry import is_registered, resolve_model
    from chatapp.ttfa.loader import load_program_source_by_name
    from chatapp.ui.terminal import end_on_hangup, keys_held_for_the_app

    # What the user types from now on is the app's, even before the app has the terminal (keys_held_for_the_app).
    with keys_held_for_the_app():
        # Every value the user typed is checked here, before seconds of model loading in the engine process (whose
        # errors would otherwise arrive only after it): the program file is read and parsed (compiling it needs
        # the tokenizer, so that part is the engine's, and its error comes back as this one does), the device is
        # resolved, the model directory is looked at; first the environment's settings.
        check_environment()
        if program is not None:
            load_program_source_by_name(program)
        if device is not None:
            resolve_device(device)
        if is_registered(model):  # here, not in the engine process: the first use prepares the default model (a bar)
            model = str(resolve_model(model))
        check_model_dir(resolve_model(model))
        backend = None
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
    temperature: TemperatureOption = 0.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
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
) -> None:
    """Stream a reply to PROMPT: sampled tokens plain, forced tokens (tool output) in italic cyan. Into a pipe or
    a file it writes exactly the reply's text (timing and errors go to stderr)."""
    from chatapp.lifecycle import starting_up
    from chatapp.settings import GenerationSettings
    from chatapp.validation import check_prompt_fits, check_prompt_text

    settings = GenerationSettings(
        temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=max_tokens, seed=seed, logprobs=logprobs
    )
    if regex is not None and json_schema is not None:
        raise SettingsError("--regex and --json-schema both constrain the reply", hint="pass one of them")
    schema = _json_schema(json_schema) if json_schema is not None else None
    prompt = _read_prompt() if prompt == "-" else prompt
    check_prompt_text(prompt)
    with starting_up():
        from chatapp.cli_render import stream_reply  # torch
        from chatapp.models import load_engine

        engine = load_engine(model, device, dtype=dtype, compile=compile)
    settings = settings.with_(routing_level=engine.resolve_level(routing))
    check_prompt_fits(len(prompt), int(engine.context_size), engine.tokenizer)
    compiled = None
    if program is not None:
        from chatapp.ttfa import load_program

        compiled = load_program(program, engine.tokenizer, engine.chat_format.program_aliases)
    constraint = engine.constraint(regex=regex, json_schema=schema) if regex or schema is not None else None
    exact = None if sys.stdout.isatty() else sys.stdout
    console = Console(highlight=False) if exact is None else err_console
    stream_reply(
        engine, prompt, settings, console, exact=exact, verbose=verbose, program=compiled, constraint=constraint
    )


def _read_prompt() -> str:
    """`generate -`: the prompt from stdin, for prompts longer than one argument may be (Linux caps one at 128 KiB).
    A final line break is the shell's (`echo`, a file's last line), not the prompt's."""
    from chatapp.validation import MAX_PROMPT_BYTES

    unreadable = "pipe the prompt into `chatapp generate -`, or pass it as an argument"
    if sys.stdin is None:  # started with stdin closed
        raise SettingsError("`generate -` reads the prompt from stdin, which is closed", hint=unreadable)
    if sys.stdin.isatty():
        err_console.print("reading the prompt: end it with ctrl+d on a line of its own", markup=False)
    stream = getattr(sys.stdin, "buffer", None)
    try:
        data = stream.read(MAX_PROMPT_BYTES + 1) if stream else sys.stdin.read(MAX_PROMPT_BYTES + 1).encode()
    except OSError as err:  # stdin is a directory, or a device that fails
        raise SettingsError(f"cannot read the prompt from stdin: {err.strerror or err}", hint=unreadable) from None
    if len(data) > MAX_PROMPT_BYTES:
        raise SettingsError(
            f"the prompt on stdin is more than {MAX_PROMPT_BYTES:,} bytes, more than any model here can read",
            hint="shorten the prompt",
        )
    # Bytes that are not UTF-8 become lone surrogates, which `check_prompt_text` names, as it does for an argument.
    return data.decode("utf-8", errors="surrogateescape").removesuffix("\n").removesuffix("\r")


def _json_schema(value: str) -> Any:
    """A `--json-schema` value: inline JSON, or the path of a file holding it."""
    import json
    from pathlib import Path

    from chatapp.errors import ConstraintError

    text = value
    path = Path(value).expanduser()
    if not value.lstrip().startswith(("{", "[")) and path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            problem = "is not UTF-8 text" if isinstance(err, UnicodeDecodeError) else f"cannot be read: {err.strerror}"
            raise ConstraintError(
                f"the --json-schema file {path} {problem}", hint="pass a JSON Schema file (UTF-8 JSON) or inline JSON"
            ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConstraintError(
            f"--json-schema is not valid JSON: {err}", hint="pass the schema inline ('{\"type\": ...}') or a .json file"
        ) from None


@app.command()
def batch(
    input: Annotated[str, typer.Argument(help="A .jsonl file of requests, or - for stdin.")],
    output: Annotated[str, typer.Option("--output", "-o", help="Where records go (- = stdout, the default).")] = "-",
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    compile: CompileOption = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Rows per device batch.")] = 32,
    samples: Annotated[int, typer.Option("--samples", min=1, max=1024, help="Samples per line that sets none.")] = 1,
    temperature: TemperatureOption = 0.0,
    top_k: TopKOption = 0,
    top_p: TopPOption = 1.0,
    max_tokens: MaxTokensOption = 256,
    seed: SeedOption = 0,
    program: Annotated[
        str | None,
        typer.Option("--program", help="TTFA program (chat, think, calc, json or a .toml) for lines that name none."),
    ] = None,
    ordered: Annotated[bool, typer.Option("--ordered", help="Write records in input order.")] = False,
    resume: Annotated[
        bool, typer.Option("--resume", help="Keep the (id, sample) records already in --output, add the rest.")
    ] = False,
    fsync: Annotated[bool, typer.Option("--fsync", help="fsync every record (survives power loss).")] = False,
    logprobs: LogprobsOption = 0,
    routing: RoutingOption = None,
) -> None:
    """Generate every line of a JSONL file in device batches: one JSON record per (id, sample), an error record per
    bad line (exit code 1 if any), a summary on stderr. The sampling options are the defaults a line may override."""
    from chatapp.batch.command import run_batch_command
    from chatapp.batch.requests import BatchDefaults
    from chatapp.batch.runner import BatchOptions
    from chatapp.settings import GenerationSettings

    settings = GenerationSettings(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        logprobs=logprobs,
        routing_level=routing,
    )
    summary = run_batch_command(
        input,
        output=output,
        model=model,
        device=device,
        dtype=dtype,
        compile=compile,
        defaults=BatchDefaults(settings=settings, samples=samples, program=program),
        options=BatchOptions(batch_size=batch_size, ordered=ordered),
        resume=resume,
        fsync=fsync,
        console=err_console,
    )
    raise typer.Exit(summary.exit_code)


@app.command()
def convert(
    source: Annotated[
        str, typer.Argument(help="A llama.cpp GGUF file (Llama or Qwen2 architecture) or a local Qwen2 directory.")
    ],
    out_dir: Annotated[str, typer.Argument(help="Where to write the STT model directory.")],
) -> None:
    """Turn a GGUF file or a Qwen2 checkpoint into an STT model directory (fresh routers; routing off until trained)."""
    from pathlib import Path

    from chatapp import store
    from chatapp.errors import DataDirError
    from chatapp.models.gguf import GGUFError, convert_gguf, is_gguf
    from chatapp.models.registry import check_model_output
    from chatapp.settings import locks_dir
    from chatapp.stt import STTForCausalLM
    from chatapp.stt.io import convert_qwen2

    # Everything is checked before the source is read (a GGUF takes seconds to dequantize): the output, then the
    # source's kind. The model is written through the store: staged beside OUT_DIR and renamed into place, so a
    # killed conversion leaves no half directory (and its staging is removed by the next run). OUT_DIR may be new,
    # empty, or an earlier output of chatapp's (its stamp); never a directory of the user's own files.
    target = Path(out_dir).expanduser()
    try:
        check_model_output(target, "output directory")
    except DataDirError:
        if _only_partial_files(target):
            raise ModelDirError(
                f"{target} holds only the temporary files of an interrupted conversion",
                hint=f"remove {target} and run the same `chatapp convert` again",
            ) from None
        raise
    locks = locks_dir()
    source_path = Path(source).expanduser()
    gguf = is_gguf(source_path)
    if not gguf and source_path.suffix.lower() == ".gguf" and source_path.is_file():
        raise GGUFError(
            f"{source_path} is not a GGUF file (it does not start with the GGUF magic bytes)",
            hint="pass a llama.cpp .gguf model file (the download may be incomplete or an HTML page), "
            "or a Qwen2 model directory",
        )
    with store.staged_dir(target, what="output directory", locks=locks) as staging:
        if gguf:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("reading and dequantizing", total=1)
                model = convert_gguf(
                    source_path, staging, lambda done, total: bar.update(task, completed=done, total=total)
                )
        else:
            model = convert_qwen2(STTForCausalLM, source_path, staging)
    typer.echo(f"wrote {target}: {model.config.num_hidden_layers} layers, STT layers {model.stt_layer_indices}")


def _only_partial_files(directory) -> bool:
    """Whether `directory` is a directory holding nothing but an earlier version's temporary files
    (`.NAME.XXXX.tmp`)."""
    try:
        names = [path.name for path in directory.iterdir()]
    except OSError:
        return False
    return bool(names) and all(name.startswith(".") and name.endswith(".tmp") for name in names)


def _training_inputs(model_dir: str | None, init: str | None, tokenizer_path: str | None, device: str | None):
    """(model, tokenizer, chat format or None, dir to copy tokenizer files from) for `train`."""
    from pathlib import Path

    import torch
    from tokenizers import Tokenizer

    from chatapp.chat import chat_format_for
    from chatapp.errors import ModelDirError, TrainingError
    from chatapp.models import resolve_model
    from chatapp.models.loader import resolve_device
    from chatapp.stt import STTConfig, STTForCausalLM

    if (model_dir is None) == (init is None):
        raise TrainingError("pass exactly one of --model DIR or --init CONFIG.json", hint="see `chatapp train --help`")
    source = resolve_model(model_dir) if model_dir else Path(tokenizer_path or "").expanduser()
    tokenizer_file = source / "tokenizer.json" if source.is_dir() else source
    if not tokenizer_file.is_file():
        raise ModelDirError(f"no tokenizer at {tokenizer_file}", hint="--init needs --tokenizer DIR|tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    resolved = resolve_device(device)
    if model_dir is not None:
        model = STTForCausalLM.from_pretrained(source, device=resolved, dtype=torch.float32)
    else:
        try:
            config = STTConfig.from_json_file(str(Path(init).expanduser()))
            config.validate_stt()
        except Exception as err:  # any parse or validation failure is the config file's fault
            from chatapp.stt.config import config_problem

            raise TrainingError(
                f"cannot use {init} as a model config: {config_problem(err)}", hint="write an STTConfig JSON"
            ) from None
        if config.vocab_size < tokenizer.get_vocab_size():
            raise TrainingError(
                f"{init}: vocab_size {config.vocab_size} < the tokenizer's {tokenizer.get_vocab_size()}",
                hint="use a config whose vocab_size is at least the tokenizer's, or another tokenizer",
            )
        model = STTForCausalLM(config).to(resolved)
    try:
        chat_format = chat_format_for(tokenizer, source if source.is_dir() else None)
    except ChatappError:
        chat_format = None
    return model, tokenizer, chat_format, tokenizer_file.parent


@app.command()
def train(
    corpus: Annotated[str, typer.Argument(help="Training data: JSONL conversations ({'messages': [...]}) or text.")],
    out: Annotated[str, typer.Option("--out", help="Output directory: checkpoints and the final model.")],
    model: Annotated[
        str | None, typer.Option("--model", help="The model to fine-tune: a name (tiny) or a model directory.")
    ] = None,
    init: Annotated[str | None, typer.Option("--init", help="STTConfig JSON to train from scratch.")] = None,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", help="With --init: a tokenizer.json or a directory holding one.")
    ] = None,
    eval_corpus: Annotated[
        str | None, typer.Option("--eval-corpus", help="Held-out data (default: 5% of CORPUS held out).")
    ] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimiser steps.")] = 1000,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per step (per GPU).")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per window.")] = 256,
    lr_scale: Annotated[float, typer.Option("--lr-scale", help="Multiplies every group's learning rate.")] = 1.0,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Linear learning-rate warmup steps.")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed for batch order and held-out split.")] = 0,
    eval_interval: Annotated[int, typer.Option("--eval-interval", min=0, help="Evaluate every N steps (0: end).")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint in --out.")] = False,
    device: DeviceOption = None,
) -> None:
    """Train an STT model (teacher targets, causal router, TPN, LM loss); multi-GPU with torchrun."""
    from pathlib import Path

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from chatapp import store
    from chatapp.models.registry import check_model_output, check_not_builtin
    from chatapp.recipes.training_data import check_corpus_path, load_sequences, split_heldout, token_stream
    from chatapp.stt.io import copy_tokenizer_files
    from chatapp.training.loop import TrainConfig, init_distributed, latest_checkpoint
    from chatapp.training.loop import train as run_training

    # --out: new, empty, or an earlier run's (its checkpoints, or the stamp a finished run leaves), which this run
    # continues (--resume) or writes again; never a directory of the user's own files, never a built-in model.
    target = Path(out).expanduser()
    if target.is_dir() and (store.is_complete(target) or latest_checkpoint(target) is not None):
        check_not_builtin(target, "--out directory")
        store.check_writable_dir(target, "--out directory", create=False)
    else:
        check_model_output(target, "--out directory")
    for path in (corpus, eval_corpus):
        if path is not None:
            check_corpus_path(path)
    dist_info = init_distributed()
    if dist_info.world_size > 1 and device is None:
        device = f"cuda:{dist_info.local_rank}" if torch.cuda.is_available() else "cpu"
    net, tok, chat_format, tokenizer_dir = _training_inputs(model, init, tokenizer, device)
    sequences = load_sequences(corpus, tok, chat_format)
    if eval_corpus is not None:
        heldout = load_sequences(eval_corpus, tok, chat_format)
    else:
        sequences, heldout = split_heldout(sequences, 0.05, seed)
    config = TrainConfig(
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr_scale=lr_scale,
        warmup_steps=warmup,
        seed=seed,
        eval_interval=eval_interval,
    )
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=not dist_info.is_main) as progress:
        task = progress.add_task("training", total=steps)

        def on_step(report) -> None:
            selected = " ".join(f"{f:.2f}" for f in report.teacher_fraction)
            progress.update(
                task,
                completed=report.step,
                description=f"loss {report.losses['lm']:.3f}  {report.tokens_per_s:,.0f} tok/s  selected [{selected}]",
            )
            if report.eval is not None:
                ppl = "  ".join(f"{mode} {value:.2f}" for mode, value in report.eval.perplexity.items())
                progress.console.print(
                    f"step {report.step}: held-out perplexity {ppl}; student F1 "
                    + " ".join(f"{f:.2f}" for f in report.eval.student_f1)
                )

        run_training(
            net,
            token_stream(sequences),
            config,
            eval_data=token_stream(heldout),
            out_dir=out,
            resume=resume,
            on_step=on_step,
            dist_info=dist_info,
        )
    if dist_info.is_main:
        copy_tokenizer_files(tokenizer_dir, Path(out))
        store.write_stamp(out)  # a finished run's: the next `chatapp train --out` here may write it again
        typer.echo(f"saved the trained model to {out}")


def _layer_list(value: str | None) -> list[int] | None:
    """`--layers`: a comma-separated list of layer indices, or None (whether each exists is `RouteOptions.check`)."""
    if value is None:
        return None
    try:
        return list(dict.fromkeys(int(part) for part in value.split(",") if part.strip()))
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a comma-separated list of layer numbers (e.g. 3,4,5)") from None


@app.command()
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
            help="kv: a skipped token still writes its K/V; predict: kv, plus a fitted prediction of the block's "
            "update; strict: the spec's mode.",
        ),
    ] = "kv",
    budget: Annotated[
        float, typer.Option("--budget", min=1.0, help="Held-out perplexity allowed, routed / routing off.")
    ] = 1.10,
    prompts: Annotated[
        int,
        typer.Option(
            "--prompts",
            min=8,
            max=4096,  # every conversation's layer inputs are cached for the fit: bounded memory
            help="Self-distilled conversations to fit and measure on (a quarter of them three turns).",
        ),
    ] = 96,
    answer_tokens: Annotated[int, typer.Option("--answer-tokens", min=8, help="Tokens per reply.")] = 128,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the prompts and the fit.")] = 0,
    tune_steps: Annotated[
        int,
        typer.Option(
            "--tune-steps",
            min=0,
            help="Fine-tune the model (LoRA) this many steps to tolerate its routing before the routers are fitted "
            "again and calibrated (~10 s a step on 2 CPU cores; resumable). 0: the weights stay frozen.",
        ),
    ] = 0,
) -> None:
    """Fit the STT routing of a model and calibrate one cutoff per layer on held-out perplexity and a copy probe
    (minutes on a CPU, the weights frozen; --tune-steps fine-tunes them to the routing too). Works on any model
    directory, e.g. one `chatapp convert` wrote; the model itself is never rewritten unless --out names it."""
    from dataclasses import replace
    from pathlib import Path

    from chatapp.models import load_model, resolve_model
    from chatapp.models.loader import check_model_dir
    from chatapp.models.registry import check_model_output, new_routed_copy
    from chatapp.settings import data_dir, locks_dir
    from chatapp.training.route import RouteOptions, write_routed
    from chatapp.training.route import route as fit_routing
    from chatapp.training.tune import TuneOptions

    # Every option, the model directory and the output are checked before the model loads (and the fit's minutes).
    options = RouteOptions(
        layers=_layer_list(layers),
        max_layers=max_layers,
        skip_mode=skip_mode,
        budget=budget,
        answer_tokens=answer_tokens,
        seed=seed,
        tune=TuneOptions(steps=tune_steps),
    )
    source = resolve_model(model)
    config = check_model_dir(source)
    layer_count, context = config.get("num_hidden_layers"), config.get("max_position_embeddings")
    if isinstance(layer_count, int) and isinstance(context, int):  # else loading names what is wrong with it
        options.check(layer_count, context)
    target = Path(out).expanduser() if out is not None else new_routed_copy(model, source)
    check_model_output(target, "--out directory" if out is not None else "routed copy")
    locks = locks_dir()

    from chatapp.recipes.smollm2.data import route_dialogues

    loaded = load_model(source, dtype="float32")  # the fit reads the model's own activations, not a lossy format's
    options = replace(options, dialogues=route_dialogues(prompts, seed, tools=loaded.chat_format.supports_tools))
    log = lambda line: err_console.print(f"[dim]{line}[/dim]")  # noqa: E731
    # The replies the fit learns from are written by the model as it is served (its default format).
    speaker = load_model(source)
    routed = fit_routing(loaded, options, log, cache_dir=data_dir() / "routing-data", speaker=speaker)
    write_routed(routed, source, target, locks)
    typer.echo(f"{routed.report.summary()}\nwrote {target}")
    if out is None:
        typer.echo(f"a routed copy of {model}: run it with --model {target.name} (`chatapp models` lists it)")


@app.command(name="eval")
def eval_model(
    corpus: Annotated[
        str | None,
        typer.Argument(
            help="Held-out data: JSONL conversations or text (default: the held-out set of the recipe that made "
            "the model: the tiny model's synthetic split, the default model's held-out tool conversations)."
        ),
    ] = None,
    model: ModelOption = None,
    seq_len: Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per window.")] = 256,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward.")] = 8,
    max_batches: Annotated[int, typer.Option("--max-batches", min=1, help="Evaluate at most this many.")] = 50,
    device: DeviceOption = None,
    tasks: Annotated[
        int | None,
        typer.Option(
            "--tasks",
            min=0,
            help="Answer N held-out questions of the model's recipe (greedy, student routing) and report its task "
            "accuracy (default without CORPUS: 300 on the tiny model, 16 on the default model; 0 with one).",
        ),
    ] = None,
) -> None:
    """Held-out perplexity with routing off / teacher / student, per-layer selected fraction and student F1;
    task accuracy (tool calls, and what else the model's recipe measures) on its held-out questions."""
    from itertools import islice

    from rich.table import Table

    from chatapp.errors import TrainingError
    from chatapp.models import load_engine, resolve_model
    from chatapp.recipes.heldout import held_out_for
    from chatapp.recipes.training_data import check_corpus_path, load_sequences, token_stream
    from chatapp.training.evaluation import conversation_batches, evaluate

    if corpus is not None:
        check_corpus_path(corpus)
    model_dir = resolve_model(model)
    # The model's own held-out set, found before the model loads: a model no recipe made fails at once.
    held_out = held_out_for(model_dir) if corpus is None or tasks else None
    task_count = tasks if tasks is not None else (held_out.default_tasks if corpus is None and held_out else 0)
    engine = load_engine(model, device, dtype="float32")  # the model's own quality, not a lossy format's
    if corpus is None and held_out is not None:
        count = tasks or held_out.default_conversations  # --tasks N also bounds the conversations (a quick look)
        batches = conversation_batches(held_out.conversations(count), engine.chat_format, batch_size)
        data = held_out.description
    else:
        # The first --max-batches windows are all that is evaluated: no more of the corpus is read (or held).
        enough = max_batches * batch_size * seq_len
        stream = token_stream(load_sequences(corpus, engine.tokenizer, engine.chat_format, enough_tokens=enough))
        if stream.num_windows(seq_len) < 1:
            raise TrainingError(f"{corpus} has {len(stream)} tokens, fewer than one window", hint="lower --seq-len")
        batches = stream.batches(batch_size, seq_len)
        data = str(corpus)
    report = evaluate(engine.model, islice(batches, max_batches))
    task_rows = held_out.tasks(engine, task_count) if held_out is not None and task_count else None
    console = Console(highlight=False)
    table = Table(title=f"{model_dir} on {data}: {report.tokens} tokens, skip mode {report.skip_mode}")
    table.add_column("routing")
    table.add_column("perplexity", justify="right")
    table.add_column("compute saved", justify="right")
    table.add_column("STT skipped", justify="right")
    table.add_column("selected per STT layer")
    for mode, ppl in report.perplexity.items():
        fractions = " ".join(f"{f:.2f}" for f in report.selected_fraction[mode])
        saved, skipped = report.compute_saved(mode), report.routed_skipped(mode)
        table.add_row(mode, f"{ppl:.3f}", f"{saved:.1%}", f"{skipped:.1%}", fractions)
    console.print(table)
    console.print(
        "student vs teacher F1: "
        + " ".join(f"{f:.2f}" for f in report.student_f1)
        + "  accuracy: "
        + " ".join(f"{a:.2f}" for a in report.student_accuracy)
    )
    if task_rows is not None:
        tally_table = Table(title=f"{task_count} held-out questions, greedy, student routing")
        tally_table.add_column("task metric")
        tally_table.add_column("accuracy", justify="right")
        for label, tally in task_rows:
            tally_table.add_row(label, str(tally))
        console.print(tally_table)


def main() -> NoReturn:
    """Console-script entry point. The process ends through `lifecycle.exit_process` (exit-time work, then
    `os._exit`), ~0.6 s sooner than Python's own finalization once a model was loaded."""
    from chatapp.lifecycle import exit_process

    code: object = 0
    try:
        app()
    except SystemExit as done:
        code = done.code
    except KeyboardInterrupt:
        err_console.print("interrupted")
        code = 130
    except BrokenPipeError:
        # The reader went away (`chatapp generate ... | head -c 5`): stop quietly, and keep the exit-time flush of
        # stdout from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    exit_process(code)


if __name__ == "__main__":
    main()
