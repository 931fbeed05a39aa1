"""`chatapp batch INPUT.jsonl` end to end on a tiny random STT model: streams, bad lines, exit codes, batch
equivalence, and resuming after `kill -9`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app


@pytest.fixture(scope="module")
def model_dir(routed_model_dir: Path) -> Path:
    return routed_model_dir


def _lines(count: int, **fields: object) -> str:
    prompts = ["What is 37*45?", "How many r are in strawberry?", "Hello!", "Paris is the capital of"]
    return "".join(
        json.dumps({"id": f"q{i}", "prompt": prompts[i % len(prompts)], "seed": i, **fields}) + "\n"
        for i in range(count)
    )


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line]


def _comparable(records: list[dict]) -> list[str]:
    return sorted(json.dumps({k: v for k, v in r.items() if k != "timings"}, sort_keys=True) for r in records)


def _batch(model_dir: Path, *args: str, input: str | None = None):
    return CliRunner().invoke(app, ["batch", *args, "--model", str(model_dir)], input=input)


def test_stdin_to_stdout_with_a_dash(model_dir: Path) -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 37*45?"},
        {"role": "assistant", "content": "1665."},
        {"role": "user", "content": "And 2*3?"},
    ]
    stdin = _lines(3) + json.dumps({"id": 9, "messages": conversation}) + "\n"
    result = _batch(model_dir, "-", "--max-tokens", "6", input=stdin)
    assert result.exit_code == 0, result.output
    records = _records(result.stdout)
    assert sorted(map(str, (r["id"] for r in records))) == ["9", "q0", "q1", "q2"]
    for record in records:
        assert set(record) >= {
            "id",
            "sample",
            "text",
            "finish_reason",
            "tokens",
            "forced",
            "tags",
            "tool_calls",
            "routing",
            "timings",
        }
        assert len(record["tokens"]) == len(record["forced"]) == len(record["tags"])
        assert record["finish_reason"] in ("stop", "length")
        assert set(record["routing"]) == {"1", "3"}
        assert all(0 <= value <= 1 for value in record["routing"].values())
    assert "4 lines ok, 0 failed, 0 skipped" in result.stderr


def test_bad_lines_each_get_an_error_record_and_a_nonzero_exit(model_dir: Path, tmp_path: Path) -> None:
    good = json.dumps({"id": "ok", "prompt": "Hello!"})
    bad = [
        "{not json",
        json.dumps({"prompt": "no id"}),
        json.dumps({"id": "t", "prompt": "x", "temperature": "hot"}),
        json.dumps({"id": "p", "prompt": "x", "program": "no-such-program"}),
        json.dumps({"id": "r", "prompt": "x", "regex": "("}),
        json.dumps({"id": "s", "prompt": "x", "json_schema": {"type": "fancy"}}),
        json.dumps({"id": "m", "messages": [{"role": "robot", "content": "x"}]}),
        json.dumps({"id": "long", "prompt": "Hello! " * 200}),
        json.dumps({"id": "ok", "prompt": "duplicate"}),
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([good, *bad]) + "\n")
    result = _batch(model_dir, str(source), "--max-tokens", "4", "--ordered")
    assert result.exit_code == 1, result.output
    records = _records(result.stdout)
    assert records[0]["id"] == "ok" and "finish_reason" in records[0]
    errors = records[1:]
    assert [e["line"] for e in errors] == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert [e["id"] for e in errors] == [None, None, "t", "p", "r", "s", "m", "long", "ok"]
    assert "invalid JSON" in errors[0]["error"]
    assert 'missing required field "id"' in errors[1]["error"]
    assert '"temperature" must be a number' in errors[2]["error"]
    assert "no-such-program" in errors[3]["error"]
    assert "regex '(' does not parse" in errors[4]["error"]
    assert "unsupported type 'fancy'" in errors[5]["error"]
    assert "robot" in errors[6]["error"]
    assert "context" in errors[7]["error"]
    assert "duplicate id" in errors[8]["error"]
    assert "1 lines ok, 9 failed" in result.stderr


def test_fatal_problems_exit_one_before_loading_anything(model_dir: Path, tmp_path: Path) -> None:
    missing = _batch(model_dir, str(tmp_path / "missing.jsonl"))
    assert missing.exit_code == 1 and "does not exist" in missing.stderr
    source = tmp_path / "in.jsonl"
    source.write_text(_lines(1))
    existing = tmp_path / "out.jsonl"
    existing.write_text('{"id":"x","sample":0,"finish_reason":"stop"}\n')
    clobber = _batch(model_dir, str(source), "-o", str(existing))
    assert clobber.exit_code == 1 and "--resume" in clobber.stderr
    assert existing.read_text() == '{"id":"x","sample":0,"finish_reason":"stop"}\n'
    stdout_resume = _batch(model_dir, str(source), "--resume")
    assert stdout_resume.exit_code == 1 and "needs an output file" in stdout_resume.stderr
    not_jsonl = _batch(model_dir, "Hello!", "--batch-size", "4")
    assert not_jsonl.exit_code == 1 and "does not exist" in not_jsonl.stderr


def test_batched_output_equals_one_at_a_time(model_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(
        _lines(6, temperature=0.9, top_k=50) + json.dumps({"id": "s", "prompt": "Hi", "samples": 3, "temperature": 1.0})
    )
    runs = {}
    for size in ("8", "1"):
        out = tmp_path / f"out{size}.jsonl"
        result = _batch(model_dir, str(source), "-o", str(out), "--batch-size", size, "--max-tokens", "6")
        assert result.exit_code == 0, result.output
        runs[size] = _records(out.read_text())
    assert len(runs["8"]) == 9
    assert _comparable(runs["8"]) == _comparable(runs["1"])
    samples = [r["tokens"] for r in runs["8"] if r["id"] == "s"]
    assert len({tuple(t) for t in samples}) == 3  # samples of one line differ


def test_programs_force_tokens_and_tag_zones(model_dir: Path) -> None:
    lines = [
        json.dumps({"id": "plain", "prompt": "Hello!"}),  # gets the --program default
        json.dumps({"id": "calc", "prompt": "What is 37*45?", "program": "calc", "temperature": 0.7}),
    ]
    result = _batch(model_dir, "-", "--max-tokens", "6", "--program", "chat", "--ordered", input="\n".join(lines))
    assert result.exit_code == 0, result.output
    plain, calc = _records(result.stdout)
    assert plain["tags"] == [["answer"]] * len(plain["tokens"])
    assert not any(plain["forced"])
    # calc forces <|python_start|>: the first token is forced, the model's expression is tagged "tool", and the
    # tool machine reports the call (answered, or refused when the reply ends inside it).
    assert calc["forced"][0] and calc["text"].startswith("<|python_start|>")
    assert calc["tags"][0] == ["tool"]
    assert calc["tool_calls"] and {"tool", "expression"} <= set(calc["tool_calls"][0])
    assert {"result", "refusal"} & set(calc["tool_calls"][0])


def test_regex_and_json_schema_lines_are_constrained(model_dir: Path) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    lines = [
        json.dumps({"id": "digits", "prompt": "What is 37*45?", "regex": "[0-9]{1,4}", "samples": 3}),
        json.dumps({"id": "json", "prompt": "Answer in JSON.", "json_schema": schema}),
        json.dumps({"id": "free", "prompt": "Hello!"}),  # an unconstrained row in the same device batch
    ]
    result = _batch(model_dir, "-", "--max-tokens", "16", "--temperature", "1.0", input="\n".join(lines))
    assert result.exit_code == 0, result.output
    by_id: dict[str, list[dict]] = {}
    for record in _records(result.stdout):
        by_id.setdefault(record["id"], []).append(record)
    # Both grammars are finite, so every row must end by completing its match well within 16 tokens.
    for record in by_id["digits"]:
        assert record["finish_reason"] == "stop"
        assert re.fullmatch("[0-9]{1,4}", record["text"]), record["text"]
    (answer,) = by_id["json"]
    assert answer["finish_reason"] == "stop"
    assert isinstance(json.loads(answer["text"])["ok"], bool)
    assert len(by_id["free"]) == 1


def test_each_row_gets_its_own_settings_exactly(model_dir: Path) -> None:
    """Differential: every record equals the Engine's own generate_batch of that prompt alone, with the line's
    settings (sample 0 uses the line's seed as is), so per-row settings reach the device batch unchanged."""
    from chatapp.models import load_engine
    from chatapp.settings import GenerationSettings

    lines = [
        {"id": "a", "prompt": "What is 37*45?", "temperature": 0.9, "seed": 7, "max_tokens": 8},
        {"id": "b", "prompt": "Hello!", "temperature": 1.3, "top_k": 20, "seed": 1, "max_tokens": 5},
        {"id": "c", "prompt": "Paris is the capital of", "temperature": 0.7, "top_p": 0.8, "seed": 3},
        {
            "id": "d",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "How are you?"},
            ],
        },
    ]
    result = _batch(model_dir, "-", "--max-tokens", "6", input="\n".join(json.dumps(line) for line in lines))
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in _records(result.stdout)}

    engine = load_engine(model_dir)
    for line in lines:
        fields = {k: v for k, v in line.items() if k not in ("id", "prompt", "messages")}
        settings = GenerationSettings(**{"max_tokens": 6, **fields})
        messages = line.get("messages") or [{"role": "user", "content": line["prompt"]}]
        (alone,) = engine.generate_batch([engine.chat_format.render_for_completion(messages)], settings)
        expected = alone.tokens + ([alone.stop_token] if alone.stop_token is not None else [])
        assert records[line["id"]]["tokens"] == expected, line["id"]
        assert records[line["id"]]["finish_reason"] == alone.finish_reason


def test_ordered_follows_input_order(model_dir: Path) -> None:
    result = _batch(
        model_dir,
        "-",
        "--max-tokens",
        "8",
        "--ordered",
        "--batch-size",
        "4",
        input=_lines(6, samples=2, temperature=1.0),
    )
    assert result.exit_code == 0, result.output
    assert [(r["id"], r["sample"]) for r in _records(result.stdout)] == [(f"q{i}", s) for i in range(6) for s in (0, 1)]


def test_a_reader_that_goes_away_ends_the_run_cleanly(model_dir: Path, tmp_path: Path) -> None:
    """`chatapp batch in.jsonl | head -1`: one clear message and exit code 1, not a BrokenPipeError traceback."""
    source = tmp_path / "in.jsonl"
    source.write_text(_lines(8))
    command = [sys.executable, "-m", "chatapp.cli", "batch", str(source), "--model", str(model_dir)]
    command += ["--batch-size", "2", "--max-tokens", "4"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    assert json.loads(process.stdout.readline())["id"].startswith("q")
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 1
    assert "output stream was closed" in stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr


def _wait_for_records(path: Path, count: int, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        if process.poll() is not None:
            pytest.fail(f"the run ended before it could be killed: {process.stderr.read() if process.stderr else ''}")
        time.sleep(0.05)
    pytest.fail("no records appeared")


def test_resume_after_kill_9_yields_every_pair_exactly_once(model_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(_lines(10, samples=2, temperature=0.8))
    out = tmp_path / "out.jsonl"
    args = [
        "batch",
        str(source),
        "-o",
        str(out),
        "--model",
        str(model_dir),
        "--batch-size",
        "4",
        "--max-tokens",
        "8",
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    process = subprocess.Popen(
        [sys.executable, "-m", "chatapp.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        _wait_for_records(out, 3, process)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    first = _records(out.read_text())
    assert 3 <= len(first) < 20
    # A kill in the middle of a write leaves a torn last line; resume must cut it off, not keep or duplicate it.
    with out.open("ab") as handle:
        handle.write(b'{"id":"q9","sample":1,"text":"tor')

    resumed = CliRunner().invoke(app, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert "torn last line" in resumed.stderr
    lines = out.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line parses: nothing torn
    assert records[: len(first)] == first  # what the killed run wrote is kept as it was
    pairs = Counter((r["id"], r["sample"]) for r in records)
    assert pairs == Counter({(f"q{i}", s): 1 for i in range(10) for s in (0, 1)})

    # Resuming a finished file does nothing and still succeeds.
    again = CliRunner().invoke(app, [*args, "--resume"])
    assert again.exit_code == 0 and "10 skipped" in again.stderr
    assert out.read_text().splitlines() == lines


def test_logprobs_lines_get_openai_shaped_logprobs(model_dir: Path) -> None:
    """`logprobs: N` adds OpenAI's `logprobs.content` (token, logprob, bytes, top_logprobs) for the reply's tokens;
    a line without it gets no such field, and its tokens are the same."""
    stdin = _lines(2, logprobs=3) + json.dumps({"id": "plain", "prompt": "What is 37*45?", "seed": 0}) + "\n"
    result = _batch(model_dir, "-", "--max-tokens", "6", input=stdin)
    assert result.exit_code == 0, result.output
    records = {r["id"]: r for r in _records(result.stdout)}
    assert "logprobs" not in records["plain"]
    assert records["plain"]["tokens"] == records["q0"]["tokens"]
    for record in (records["q0"], records["q1"]):
        content = record["logprobs"]["content"]
        stop = record["finish_reason"] == "stop"
        assert len(content) == len(record["tokens"]) - stop  # the reply's tokens: a final stop token is not content
        assert "".join(bytes(entry["bytes"]).decode("utf-8", "replace") for entry in content) == record["text"]
        for entry in content:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
            tops = [alt["logprob"] for alt in entry["top_logprobs"]]
            assert tops == sorted(tops, reverse=True)
            assert all(set(alt) == {"token", "logprob", "bytes"} for alt in entry["top_logprobs"])
            assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]


def test_a_bad_logprobs_value_is_an_error_record(model_dir: Path) -> None:
    stdin = json.dumps({"id": "x", "prompt": "Hi", "logprobs": 50}) + "\n"
    result = _batch(model_dir, "-", input=stdin)
    assert result.exit_code == 1
    (record,) = _records(result.stdout)
    assert record == {
        "id": "x",
        "line": 1,
        "error": "logprobs must be between 0 and 20, got 50; fix: use 0 for none, or up to 20 alternatives per token",
    }
    assert "Traceback" not in result.output
