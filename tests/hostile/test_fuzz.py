"""Issue 17: arbitrary input at every reader. Whatever a user feeds in, the only exception is a `ChatappError`, the
cost is bounded, nothing is lost and good lines are still answered.

Fast and deterministic (the profile in tests/conftest.py derandomizes); examples are small, the work they cause is
bounded by the limits under test, not by the examples.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.batch.output import scan_output
from chatapp.batch.requests import BatchDefaults, LineRequest
from chatapp.batch.runner import run_batch
from chatapp.errors import ChatappError
from chatapp.settings import GenerationSettings
from chatapp.trie.budget import CompileBudget, metered
from chatapp.trie.json_schema import schema_to_regex
from chatapp.trie.regex import compile_regex
from chatapp.ttfa.source import parse_program_toml
from chatapp.validation import check_prompt_chars, prompt_chars
from tests.cli.test_batch_runner import ListSink, ScriptedEngine

FIELDS = ("id", "prompt", "messages", "samples", "program", "regex", "json_schema", "top_k", "max_tokens", "seed",
          "temperature", "top_p", "logprobs")
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
GOOD = json.dumps({"id": "good", "prompt": "[5, 6]", "max_tokens": 3})
FAST = CompileBudget(max_states=5_000, seconds=2.0)


class RealLimitsPreparer:
    """The runner's preparer with the real prompt limit and real regex / schema compiles (no model needed)."""

    def prompt_ids(self, request: LineRequest) -> list[int]:
        check_prompt_chars(prompt_chars(request.prompt, request.messages), 64, 4)
        return [7, 8]

    def program(self, name: str) -> str:
        if name not in ("chat", "think"):
            raise ChatappError(f"no program named {name!r}")
        return name

    def constraint(self, request: LineRequest):
        with metered("constraint", FAST):
            if request.regex is not None:
                return compile_regex(request.regex)
            return compile_regex(schema_to_regex(request.json_schema))


@settings(max_examples=60)
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5))
def test_any_json_values_in_any_batch_field_cost_a_record_never_a_crash(fields: dict) -> None:
    line = json.dumps({"id": "x", "prompt": "[1]", **fields})
    sink = ListSink()
    started = time.monotonic()
    summary = run_batch(
        ScriptedEngine(), RealLimitsPreparer(), [line.encode(), GOOD.encode()],
        BatchDefaults(settings=GenerationSettings(max_tokens=3)), sink,
    )
    assert time.monotonic() - started < 20
    good = [r for r in sink.records if r.get("id") == "good"]
    assert good and all("finish_reason" in r for r in good)  # the good line after it is still answered
    assert summary.lines_ok + summary.lines_failed == 2  # nothing dropped


@settings(max_examples=40)
@given(st.binary(max_size=200))
def test_any_bytes_as_a_batch_line_cost_a_record(data: bytes) -> None:
    sink = ListSink()
    run_batch(ScriptedEngine(), RealLimitsPreparer(), [data, GOOD.encode()], BatchDefaults(), sink)
    assert any(r.get("id") == "good" and "finish_reason" in r for r in sink.records)


toml_values = st.recursive(
    st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"


PROGRAM_KEYS = ("name", "tags", "max_genned_per_zone", "pad", "description", "label", "force", "until", "jump_on",
                "goto", "budget", "timeout_token")


@settings(max_examples=60)
@given(
    st.dictionaries(st.sampled_from(PROGRAM_KEYS), toml_values, max_size=4),
    st.lists(st.dictionaries(st.sampled_from(PROGRAM_KEYS), toml_values, max_size=4), max_size=3),
)
def test_any_toml_program_is_parsed_or_refused_with_a_program_error(top: dict, zones: list[dict]) -> None:
    text = "".join(f"{json.dumps(k)} = {_toml(v)}\n" for k, v in top.items())
    for zone in zones:
        text += "[[zones]]\n" + "".join(f"{json.dumps(k)} = {_toml(v)}\n" for k, v in zone.items())
    with contextlib.suppress(ChatappError):
        parse_program_toml(text, file="fuzz.toml")


@settings(max_examples=40)
@given(st.binary(max_size=300))
def test_any_bytes_as_a_program_file_are_a_program_error_at_worst(data: bytes) -> None:
    from chatapp.ttfa.source import load_program_source

    path = Path("/tmp") / f"chatapp-fuzz-{id(data)}.toml"
    try:
        path.write_bytes(data)
        with contextlib.suppress(ChatappError):
            load_program_source(path)
    finally:
        path.unlink(missing_ok=True)


@settings(max_examples=40)
@given(st.binary(max_size=400))
def test_any_bytes_as_a_resumed_output_are_read_or_refused_untouched(tmp_path_factory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("resume") / "out.jsonl"
    path.write_bytes(data)
    try:
        existing = scan_output(path)
    except ChatappError:
        assert path.read_bytes() == data  # refused: left exactly as it was
        return
    kept = path.read_bytes()
    assert data.startswith(kept)
    if kept != data:  # only a torn record after a valid one is ever cut
        assert existing.records >= 1 and data[len(kept):].startswith(b'{"i'[: len(data) - len(kept)])


@settings(max_examples=20)
@given(st.binary(max_size=600))
def test_any_bytes_as_the_history_db_are_moved_aside_or_refused(tmp_path_factory, data: bytes) -> None:
    from chatapp.ui.history import open_history

    folder = tmp_path_factory.mktemp("db")
    path = folder / "history.sqlite3"
    path.write_bytes(data)
    try:
        store = open_history(path, move_aside=True)
    except ChatappError:
        assert path.read_bytes() == data
        return
    store.create_conversation("t")
    store.close()
    moved = [p for p in folder.iterdir() if ".damaged-" in p.name and not p.name.endswith(("-wal", "-shm"))]
    if data and not moved:
        sqlite3.connect(path).execute("SELECT 1")  # it was usable as it was
    for aside in moved:
        assert aside.read_bytes() == data  # nothing lost


@settings(max_examples=12)
@given(st.binary(max_size=300), st.sampled_from(["config.json", "tokenizer.json"]))
def test_any_bytes_in_a_model_dir_file_are_a_model_dir_error(tmp_path_factory, data: bytes, name: str) -> None:
    import shutil

    from chatapp.models.loader import check_model_dir, load_model
    from chatapp.models.registry import tiny_model_dir as default_model_dir

    folder = tmp_path_factory.mktemp("model")
    for file in ("config.json", "tokenizer.json"):
        shutil.copy(default_model_dir() / file, folder / file)
    (folder / "model.safetensors").symlink_to(default_model_dir() / "model.safetensors")
    (folder / name).write_bytes(data)
    try:
        check_model_dir(folder)
        if name == "config.json":
            load_model(folder)
    except ChatappError:
        pass
