"""Issue 41, row 10 and the smaller points: every bad value gets one `error:` line and one `fix:` line and exit 1;
batch error records carry their fix; `generate -` reads the prompt from stdin; an empty prompt is refused.

The walk over what the CLI can print: every option of every command (read from the command tree, so a new option
is walked as soon as it exists) given a value of the wrong type, out of its range, or none, and unknown options and
commands; tables of values that parse but chatapp refuses (settings, environment variables, paths); every kind of
bad batch line; and every place in chatapp/ that builds a `ChatappError`, which must pass its fix (`hint=`).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import chatapp.errors
from chatapp.cli import app
from chatapp.errors import ChatappError, user_message

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny"]


def _one_error_and_fix(args: list[str], *, input: str | bytes | None = None) -> tuple[str, str]:
    """Run the CLI and check it refused with exactly one `error:` line followed by one `fix:` line, exit code 1, no
    traceback and no usage box; return the two lines' text."""
    result = runner.invoke(app, args, input=input)
    output = result.output
    assert result.exit_code == 1, (args, output)
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
    assert "Traceback" not in output and "Usage:" not in output and "╭" not in output, (args, output)
    lines = output.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    fixes = [i for i, line in enumerate(lines) if line.startswith("fix:")]
    assert len(errors) == 1 and len(fixes) == 1, (args, output)
    assert fixes[0] == errors[0] + 1, (args, output)
    fix = lines[fixes[0]].removeprefix("fix:").strip()
    assert fix, (args, output)
    return lines[errors[0]].removeprefix("error:").strip(), fix


# --- every option of every command ----------------------------------------------------------------------------------
def _commands() -> Iterator[tuple[list[str], object]]:
    """(the words that name it, the Click command) for every command, subcommands included."""
    stack: list[tuple[list[str], object]] = [([], typer.main.get_command(app))]
    while stack:
        path, command = stack.pop()
        subcommands = getattr(command, "commands", None)
        if subcommands:
            stack.extend(([*path, name], sub) for name, sub in subcommands.items())
        else:
            yield path, command


def _required_arguments(command) -> list[str]:
    """Placeholder values for a command's required arguments (Click checks option values before any runs)."""
    return ["x" for param in command.params if param.param_type_name == "argument" and param.required]


def _bad_values(param) -> Iterator[str]:
    """Values Click itself refuses for an option: the wrong type, and outside a declared range."""
    kind = param.type
    name = type(kind).__name__
    if name in ("IntParamType", "IntRange"):
        yield "many"
        yield "1.5"
    if name in ("FloatParamType", "FloatRange"):
        yield "lots"
    if getattr(kind, "min", None) is not None:
        yield str(kind.min - 1)
    if getattr(kind, "max", None) is not None:
        yield str(kind.max + 1)


def _usage_cases() -> Iterator[tuple[list[str], list[str]]]:
    """(the command's words, the arguments) of every usage error the walk makes."""
    for path, command in _commands():
        arguments = _required_arguments(command)
        yield path, [*path, *arguments, "--no-such-option"]
        if arguments:
            yield path, path  # a required argument missing
        for param in command.params:
            if param.param_type_name != "option" or getattr(param, "is_flag", False):
                continue
            option = param.opts[0]
            yield path, [*path, *arguments, option]  # the option without its value
            for value in _bad_values(param):
                yield path, [*path, *arguments, f"{option}={value}"]
    yield [], ["no-such-command"]
    yield ["program"], ["program", "no-such-command"]


USAGE_CASES = list(_usage_cases())


def test_the_walk_covers_every_command_and_typed_option() -> None:
    named = {" ".join(path) for path, _ in _commands()}
    assert {"generate", "batch", "run", "train", "route", "eval", "convert", "calc", "program show"} <= named
    walked = {" ".join(args) for _, args in USAGE_CASES}
    assert "generate x --max-tokens=many" in walked and "batch x --batch-size=0" in walked


@pytest.mark.parametrize(("command", "args"), USAGE_CASES, ids=[" ".join(args) for _, args in USAGE_CASES])
def test_every_usage_error_is_one_error_and_its_fix(command: list[str], args: list[str]) -> None:
    """Each names the command whose --help shows what it takes."""
    _, fix = _one_error_and_fix(args)
    assert fix.endswith(f"{' '.join(['chatapp', *command])} --help`"), fix


# --- values that parse but chatapp refuses --------------------------------------------------------------------------
SETTINGS_CASES = [
    (["--max-tokens", "0"], "max_tokens must be between 1 and"),
    (["--max-tokens", "-1"], "max_tokens must be between 1 and"),
    (["--max-tokens", "1000000000"], "max_tokens must be between 1 and"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "2"], "top_p must be in (0, 1]"),
    (["--top-k", "-1"], "top_k must be between 0 and"),
    (["--seed", "-1"], "seed must be between 0 and"),
    (["--seed", str(2**70)], "seed must be between 0 and"),
    (["--logprobs", "21"], "logprobs must be between 0 and 20"),
    (["--logprobs", "-1"], "logprobs must be between 0 and 20"),
    (["--dtype", "float7"], "unknown weight format 'float7'"),
]


@pytest.mark.parametrize(("options", "message"), SETTINGS_CASES, ids=[" ".join(o) for o, _ in SETTINGS_CASES])
@pytest.mark.parametrize("command", ["generate", "batch"])
def test_every_bad_setting_is_one_error_and_its_fix(tmp_path: Path, command: str, options, message: str) -> None:
    first = "Say hi" if command == "generate" else str(tmp_path / "in.jsonl")
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    error, _ = _one_error_and_fix([command, first, *TINY, *options])
    assert message in error


GENERATE_CASES = [
    (["", *TINY], "the prompt is empty"),
    (["   \n\t", *TINY], "the prompt is only white space"),
    (["a\udcffb", *TINY], "the prompt holds the byte 0xff, which is not UTF-8"),
    (["hi", *TINY, "--regex", "a", "--json-schema", "{}"], "--regex and --json-schema both constrain the reply"),
    (["hi", *TINY, "--json-schema", "{nope"], "--json-schema is not valid JSON"),
    (["hi", *TINY, "--json-schema", sys.executable], "is not UTF-8 text"),
    (["hi", "--model", "/nowhere/at/all"], "/nowhere/at/all"),
    (["hi", *TINY, "--device", "toaster"], "toaster"),
]


@pytest.mark.parametrize(("args", "message"), GENERATE_CASES, ids=[repr(a[0]) + str(a[1:]) for a, _ in GENERATE_CASES])
def test_generate_refuses_with_one_error_and_its_fix(args: list[str], message: str) -> None:
    error, _ = _one_error_and_fix(["generate", *args])
    assert message in error


ENVIRONMENT_CASES = [
    ("CHATAPP_THREADS", "abc"),
    ("CHATAPP_THREADS", "0"),
    ("CHATAPP_DTYPE", "float7"),
    ("CHATAPP_COMPILE", "maybe"),
    ("CHATAPP_DEFAULT_MODEL", "no-such-model"),
]


@pytest.mark.parametrize(("name", "value"), ENVIRONMENT_CASES, ids=[f"{n}={v}" for n, v in ENVIRONMENT_CASES])
@pytest.mark.parametrize("command", [["generate", "hi"], ["batch", "-"]])
def test_every_bad_environment_setting_is_one_error_and_its_fix(monkeypatch, command, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    model = [] if name == "CHATAPP_DEFAULT_MODEL" else TINY
    error, _ = _one_error_and_fix([*command, *model], input='{"id": 1, "prompt": "hi"}\n')
    assert name in error or value in error, error


@pytest.mark.parametrize("name", ["model.gguf", "model.bin"])
def test_a_gguf_file_as_the_model_points_at_convert(tmp_path: Path, name: str) -> None:
    """A GGUF file (named so, or by its magic bytes) given as --model: the fix is `chatapp convert`."""
    gguf = tmp_path / name
    gguf.write_bytes(b"GGUF" + bytes(60))
    for command in (["generate", "hi"], ["batch", "-"], ["run", "--in-process"]):
        error, fix = _one_error_and_fix([*command, "--model", str(gguf)], input="")
        assert "is a GGUF file" in error and f"chatapp convert {gguf} DIR" in fix, (command, error, fix)


def test_other_commands_refuse_with_one_error_and_its_fix(tmp_path: Path) -> None:
    (tmp_path / "out.jsonl").write_text('{"id": 1}\n')
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    cases = [
        (["calc", "__import__('os')"], "the calculator refused"),
        (["batch", str(tmp_path / "missing.jsonl"), *TINY], "does not exist"),
        (["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), *TINY], "already exists"),
        (["batch", "-", "--resume", *TINY], "--resume needs an output file"),
        (["batch", str(tmp_path), *TINY], "is a directory"),
        (["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path), *TINY], "is a directory"),
        (["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path), "--resume", *TINY], "is a directory"),
        (["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "no" / "r.jsonl"), *TINY], "cannot open"),
        (["program", "check", str(tmp_path / "missing.toml"), "--tokenizer", "tiny"], "missing.toml"),
        (["program", "show", "nosuchprogram", "--tokenizer", "tiny"], "nosuchprogram"),
        (["train", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "t")], "exactly one of --model"),
        (["convert", str(tmp_path / "missing.gguf"), str(tmp_path / "in.jsonl")], "already exists"),
        (["run", *TINY, "--in-process", "--db", str(tmp_path)], "is a directory"),
    ]
    for args, message in cases:
        error, _ = _one_error_and_fix(args)
        assert message in error, (args, error)


# --- batch records --------------------------------------------------------------------------------------------------
BAD_LINES = [
    "{oops",
    "[1, 2]",
    '{"prompt": "no id"}',
    '{"id": true, "prompt": "x"}',
    '{"id": "", "prompt": "x"}',
    '{"id": 1}',
    '{"id": 1, "prompt": "x", "messages": []}',
    '{"id": 1, "prompt": 5}',
    '{"id": 1, "prompt": ""}',
    '{"id": 1, "prompt": " \\n\\t"}',
    '{"id": 1, "messages": "hi"}',
    '{"id": 1, "messages": [5]}',
    '{"id": 1, "prompt": "x", "max_tokens": 0}',
    '{"id": 1, "prompt": "x", "max_tokens": 1.5}',
    '{"id": 1, "prompt": "x", "temperature": NaN}',
    '{"id": 1, "prompt": "x", "temperature": 1e999}',
    '{"id": 1, "prompt": "x", "top_p": 0}',
    '{"id": 1, "prompt": "x", "logprobs": 99}',
    '{"id": 1, "prompt": "x", "samples": 0}',
    '{"id": 1, "prompt": "x", "samples": 100000}',
    '{"id": 1, "prompt": "x", "colour": "red"}',
    '{"id": 1, "prompt": "x", "regex": "a", "json_schema": {}}',
    '{"id": 1, "prompt": "x", "json_schema": 3}',
    '{"id": 1, "prompt": "x", "regex": "(("}',
    '{"id": 1, "prompt": "x", "json_schema": {"type": "fancy"}}',
    '{"id": 1, "prompt": "x", "program": "no-such-program"}',
    '{"id": 1, "prompt": "\\ud800"}',
    '{"id": 1, "messages": [{"role": "robot", "content": "x"}]}',
]


def test_every_batch_error_record_carries_its_fix(tmp_path: Path) -> None:
    bad = [line.replace('"id": 1', f'"id": {100 + number}') for number, line in enumerate(BAD_LINES)]
    lines = ['{"id": 1, "prompt": "Hi", "max_tokens": 2}', *bad, '{"id": 1, "prompt": "a duplicate of the first id"}']
    source = tmp_path / "in.jsonl"
    source.write_bytes("\n".join(lines).encode() + b"\n\xff\xfe\n")
    result = runner.invoke(app, ["batch", str(source), *TINY])
    assert result.exit_code == 1, result.output
    records = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    errors = [record for record in records if "error" in record and "finish_reason" not in record]
    assert len(errors) == len(lines)  # every line but the first good one, and the line that is not UTF-8
    for record in errors:
        message, _, fix = record["error"].partition("; fix: ")
        assert message and fix and "\n" not in record["error"], record
    assert sum("duplicate id" in record["error"] for record in errors) == 1  # each bad line fails for its own reason


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["id", "prompt", "messages", "max_tokens", "top_p", "samples", "seed", "regex", "x"]),
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=5),
        max_size=5,
    )
)
def test_any_bad_line_is_an_error_with_its_fix(obj: dict) -> None:
    """Whatever a line holds, it is a request or an error whose text is the message and its fix on one line."""
    from chatapp.batch.requests import BatchDefaults, LineError, parse_line

    parsed = parse_line(1, json.dumps(obj), BatchDefaults())
    if isinstance(parsed, LineError):
        message, _, fix = parsed.error.partition("; fix: ")
        assert message and fix and "\n" not in parsed.error


# --- generate - ----------------------------------------------------------------------------------------------------
def test_generate_dash_reads_the_prompt_from_stdin() -> None:
    """The same prompt through stdin (with the shell's final line break) and as an argument: the same reply."""
    prompt = "What is 2+3?"
    through_argument = runner.invoke(app, ["generate", prompt, *TINY, "--max-tokens", "12"])
    through_stdin = runner.invoke(app, ["generate", "-", *TINY, "--max-tokens", "12"], input=prompt + "\n")
    assert through_argument.exit_code == 0 and through_stdin.exit_code == 0, through_stdin.output
    assert through_stdin.stdout == through_argument.stdout and through_stdin.stdout


def test_a_prompt_longer_than_one_argument_arrives_whole_through_a_pipe(tmp_path: Path) -> None:
    """300 KiB (Linux caps one argument at 128 KiB) through a real pipe: every character is read, as the context
    check's count shows (the tiny model's context cannot hold it)."""
    prompt = ("many words " * 30_000)[: 300 * 1024]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "chatapp.cli", "generate", "-", *TINY],
        input=prompt.encode(), env=env, capture_output=True, timeout=120,
    )  # fmt: skip
    stderr = done.stderr.decode()
    assert done.returncode == 1, stderr
    assert f"the prompt is {len(prompt):,} characters" in stderr, stderr
    assert re.search(r"^fix: ", stderr, re.MULTILINE) and "Traceback" not in stderr


@pytest.mark.parametrize("stdin", [b"", b"\n", b"  \n\t\n"], ids=["nothing", "a line break", "white space"])
def test_an_empty_prompt_on_stdin_is_refused(stdin: bytes) -> None:
    error, fix = _one_error_and_fix(["generate", "-", *TINY], input=stdin)
    assert error.startswith("the prompt is") and "generate" in fix


def test_a_stream_that_never_ends_is_read_only_to_the_bound(monkeypatch) -> None:
    """Memory is bounded: what stdin holds past the bound is not read, and the prompt is refused with its fix."""
    monkeypatch.setattr("chatapp.validation.MAX_PROMPT_BYTES", 1000)
    error, fix = _one_error_and_fix(["generate", "-", *TINY], input=b"x" * 5000)
    assert "more than 1,000 bytes" in error and fix == "shorten the prompt"


def test_a_closed_stdin_is_named() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "chatapp.cli", "generate", "-", *TINY],
        env=env, capture_output=True, timeout=120,
        preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    stderr = done.stderr.decode()
    assert done.returncode == 1 and "Traceback" not in stderr, stderr
    assert re.search(r"^error: .*stdin, which is closed$", stderr, re.MULTILINE), stderr
    assert re.search(r"^fix: ", stderr, re.MULTILINE), stderr


def test_a_prompt_on_stdin_that_is_not_utf8_is_named() -> None:
    error, fix = _one_error_and_fix(["generate", "-", *TINY], input=b"caf\xe9 au lait")
    assert "the byte 0xe9, which is not UTF-8" in error and "UTF-8" in fix


# --- every raise site passes its fix --------------------------------------------------------------------------------
def _sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), str(path)) for path in sorted((ROOT / "chatapp").rglob("*.py"))}


def _error_classes(trees: dict[Path, ast.Module]) -> set[str]:
    """The names of `ChatappError` and every class that derives from it, in any module."""
    names = {"ChatappError"}
    grown = True
    while grown:
        grown = False
        for tree in trees.values():
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and node.name not in names:
                    bases = {getattr(base, "id", getattr(base, "attr", None)) for base in node.bases}
                    if bases & names:
                        names.add(node.name)
                        grown = True
    return names


def _called(node: ast.Call) -> str | None:
    return getattr(node.func, "id", getattr(node.func, "attr", None))


def _forwards_hint(keyword: ast.keyword) -> bool:
    return keyword.arg == "hint" and isinstance(keyword.value, ast.Name) and keyword.value.id == "hint"


def _factories(tree: ast.Module, classes: set[str]) -> set[str]:
    """Functions of a module that build an error with the `hint` their caller passes (`hint=hint`), such as the
    program compiler's `self.error(...)`: their calls are raise sites too."""
    found = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef) or function.name == "__init__":
            continue
        if not any(arg.arg == "hint" for arg in (*function.args.args, *function.args.kwonlyargs)):
            continue
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Call)
                and _called(node) in classes
                and any(_forwards_hint(k) for k in node.keywords)
            ):
                found.add(function.name)
    return found


def test_every_chatapp_error_is_raised_with_its_fix() -> None:
    trees = _sources()
    classes = _error_classes(trees)
    assert {"SettingsError", "ModelDirError", "GGUFError", "ServedFormatError"} <= classes
    missing = []
    for path, tree in trees.items():
        builders = classes | _factories(tree, classes)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called(node) in builders:
                if not any(keyword.arg in ("hint", None) for keyword in node.keywords):
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {_called(node)}(...)")
            elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Name) and node.exc.id in classes:
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno} raise {node.exc.id}")  # no message either
    assert not missing, "raised without hint=:\n" + "\n".join(missing)


def test_the_raise_site_check_sees_factories() -> None:
    """The compiler's `self.error(...)` and the settings checks count as raise sites (the check is not vacuous)."""
    trees = _sources()
    classes = _error_classes(trees)
    assert "error" in _factories(trees[ROOT / "chatapp" / "ttfa" / "compiler.py"], classes)
    assert {"_check_int", "_check_number"} <= _factories(trees[ROOT / "chatapp" / "settings.py"], classes)


def test_an_error_forwarded_without_a_fix_still_shows_one() -> None:
    """A hint forwarded from another error may be None: the class's own fix stands in, and a line break in either
    never makes a second line."""
    for cls in (getattr(chatapp.errors, name) for name in dir(chatapp.errors)):
        if isinstance(cls, type) and issubclass(cls, ChatappError):
            shown = user_message(cls("bad\nvalue"))
            assert shown.error == "bad value" and shown.fix and "\n" not in shown.fix
            assert shown.one_line() == f"bad value; fix: {shown.fix}"
