"""`chatapp batch`: files and streams in, a loaded model, a summary out.

Everything a user can get wrong before generation starts (input missing, output in the way, --resume on stdout, a
bad model directory) is raised as a `ChatappError` before the model is loaded, so mistakes cost no waiting.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from chatapp.batch.output import ExistingOutput, FileSink, RecordSink, StreamSink, scan_output
from chatapp.batch.progress import progress_for
from chatapp.batch.requests import BatchDefaults, LineRequest
from chatapp.batch.runner import BatchOptions, BatchSummary, run_batch
from chatapp.errors import (
    BatchFileError,
    ConstraintError,
    ContextOverflowError,
    ProgramError,
)
from chatapp.validation import check_prompt_fits, prompt_chars

STDIO = "-"


def read_input(source: str) -> list[bytes]:
    """The raw lines of the input (`-` is stdin). Lines stay bytes so each is decoded, and can fail, on its own."""
    if source == STDIO:
        data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
    else:
        path = Path(source).expanduser()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BatchFileError(
                f"input file {path} does not exist", hint="pass a .jsonl file, or - for stdin"
            ) from None
        except IsADirectoryError:
            raise BatchFileError(f"the input {path} is a directory", hint="pass a .jsonl file, or - for stdin") from None
        except OSError as err:
            raise BatchFileError(
                f"cannot read input file {path}: {err.strerror}",
                hint="fix the input file's permissions, or pass its contents on stdin (-)",
            ) from None
    # Split on "\n" only: a JSON string may legally hold U+2028 and friends, which str.splitlines would break.
    return data.split(b"\n")


def open_output(target: str, *, resume: bool, fsync: bool, input_source: str) -> tuple[RecordSink, ExistingOutput]:
    """The sink for records and what an earlier run already wrote there (empty unless resuming)."""
    if target == STDIO:
        if resume:
            raise BatchFileError("--resume needs an output file", hint="add -o OUTPUT.jsonl")
        return StreamSink(), ExistingOutput()
    path = Path(target).expanduser()
    if input_source != STDIO and path.resolve() == Path(input_source).expanduser().resolve():
        raise BatchFileError(f"the output {path} is the input file", hint="write the records to another file")
    if path.is_dir():
        raise BatchFileError(
            f"the output {path} is a directory", hint=f"name a file for the records, e.g. -o {path / 'records.jsonl'}"
        )
    if resume:
        existing = scan_output(path)
    elif path.exists() and path.stat().st_size > 0:
        # Never clobber earlier results: they may be hours of generation.
        raise BatchFileError(
            f"output file {path} already exists",
            hint="pass --resume to continue it, or choose another output file",
        )
    else:
        existing = ExistingOutput()
    return FileSink(path, fsync=fsync), existing


class ModelPreparer:
    """Resolves a line's prompt, program and constraint with the engine's tokenizer and chat format."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.aliases = engine.chat_format.program_aliases
        self.chat_format = engine.chat_format
        self.context_size = int(engine.context_size)
        self.vocab_size = int(engine.model.config.vocab_size)
        # Many lines name the same program or pattern: compile each once (a failure is remembered too).
        self._programs: dict[str, Any] = {}
        self._dfas: dict[str, Any] = {}
        self._starts: dict[tuple[str, str], ConstraintError | None] = {}  # (program, constraint): its start's check
        self._constraint_vocab: Any = None

    def prompt_ids(self, request: LineRequest) -> list[int]:
        messages: Sequence[dict[str, Any]] = request.messages or ({"role": "user", "content": request.prompt},)
        check_prompt_fits(prompt_chars(request.prompt, request.messages), self.context_size, self.tokenizer)
        ids = list(self.chat_format.render_for_completion(list(messages)))
        if len(ids) >= self.context_size:
            raise ContextOverflowError(
                f"the prompt is {len(ids)} tokens but the model's context is {self.context_size}",
                hint="shorten the prompt",
            )
        return ids

    def program(self, name: str) -> Any:
        if name not in self._programs:
            from chatapp.ttfa import load_program

            try:
                self._programs[name] = load_program(name, self.tokenizer, self.aliases)
            except ProgramError as err:
                self._programs[name] = err
        program = self._programs[name]
        if isinstance(program, ProgramError):
            raise program
        return program

    def constraint(self, request: LineRequest) -> Any:
        """A fresh constraint for one row: a constraint holds its row's grammar state, so rows never share one."""
        field = "regex" if request.regex is not None else "json_schema"
        try:
            from chatapp.trie.constraint import Constraint
        except ImportError:
            raise ConstraintError(
                f'"{field}" constraints are not available in this build of chatapp',
                hint=f'remove the "{field}" field from the line',
            ) from None
        if self._constraint_vocab is None:
            self._constraint_vocab = self.engine.constraint_vocab
        end_token = getattr(self.chat_format, "assistant_end_id", None)
        key = json.dumps({field: request.regex if request.regex is not None else request.json_schema}, sort_keys=True)
        if key not in self._dfas:
            try:
                if request.regex is not None:
                    built = Constraint.regex(request.regex, self._constraint_vocab, end_token)
                else:
                    built = Constraint.json_schema(request.json_schema or {}, self._constraint_vocab, end_token)
                self._dfas[key] = built.dfa
            except ConstraintError as err:
                self._dfas[key] = err
        dfa = self._dfas[key]
        if isinstance(dfa, ConstraintError):
            raise dfa
        constraint = Constraint(self._constraint_vocab, dfa, end_token)
        if request.program is not None:
            self._check_program_start(request.program, field, key, constraint)
        return constraint

    def _check_program_start(self, name: str, field: str, key: str, constraint: Any) -> None:
        """The line's program must not force text its constraint forbids (`check_forced_start`); once per pair."""
        from chatapp.engine.constraints import check_forced_start

        pair = (name, key)
        if pair not in self._starts:
            try:
                check_forced_start(
                    self.program(name),
                    constraint,
                    program_name=f'"program" {name!r}',
                    constraint_name=f'"{field}"',
                    drop=f'"program" or "{field}"',
                )
                self._starts[pair] = None
            except ConstraintError as err:
                self._starts[pair] = err
        if (err := self._starts[pair]) is not None:
            raise err


def run_batch_command(
    input_source: str,
    *,
    output: str,
    model: str | None,
    device: str | None,
    defaults: BatchDefaults,
    dtype: str | None = None,
    compile: bool | None = None,
    options: BatchOptions,
    resume: bool,
    fsync: bool,
    console: Console,
) -> BatchSummary:
    """Everything `chatapp batch INPUT.jsonl` does after parsing its options; prints the summary on `console`."""
    from chatapp.lifecycle import starting_up
    from chatapp.models import load_engine

    if input_source == STDIO and sys.stdin.isatty():
        # Without a pipe, `-` waits for typed lines; say so rather than look hung.
        console.print("reading JSONL lines from the terminal; end with Ctrl-D", highlight=False, markup=False)
    lines = read_input(input_source)
    sink, existing = open_output(output, resume=resume, fsync=fsync, input_source=input_source)
    try:
        if existing.truncated_bytes:
            console.print(
                f"resume: cut a torn last line ({existing.truncated_bytes} bytes) from {output}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )
        with starting_up():
            engine = load_engine(model, device, dtype=dtype, compile=compile)
        level = engine.resolve_level(defaults.settings.routing_level)
        settings = engine.default_settings(defaults.settings, defaults.chosen)  # the model's, under the options
        defaults = replace(defaults, settings=settings.with_(routing_level=level))
        preparer = ModelPreparer(engine)
        summary = run_batch(
            engine,
            preparer,
            lines,
            defaults,
            sink,
            options=options,
            existing=existing,
            progress=progress_for(console),
        )
    finally:
        sink.close()
    console.print(f"batch: {summary.describe()}", highlight=False, markup=False, soft_wrap=True)
    return summary
