"""The batch runner's scheduling and bookkeeping, against a scripted engine that honours the Engine's contract.

The real engine is exercised end to end in test_batch_cli.py; here a stand-in whose rows are a pure function of
(prompt, settings) lets every ordering, failure and resume case be checked exactly and fast.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatapp.batch.output import ExistingOutput
from chatapp.batch.records import row_record
from chatapp.batch.requests import BatchDefaults, LineRequest
from chatapp.batch.runner import BatchOptions, run_batch, sample_seed
from chatapp.engine.events import PromptInfo, Step, TokenEvent, ToolEvent
from chatapp.engine.reply import Reply
from chatapp.errors import ContextOverflowError, ProgramError
from chatapp.settings import GenerationSettings

STOP = 1
POISON = 666  # a prompt containing this token makes the scripted engine raise while the row is running


class ScriptedEngine:
    """Rows emit a pseudo-random token run determined by (prompt, seed, max_tokens) only, one token per step."""

    stt_layers = [1, 3]

    def __init__(self) -> None:
        self.batch_sizes: list[int] = []

    def new_reply(self, row: int = 0) -> Reply:
        return Reply(row, num_layers=4, stt_layers=self.stt_layers)

    @staticmethod
    def plan(prompt: list[int], settings: GenerationSettings) -> list[int]:
        rng = random.Random(f"{prompt}/{settings.seed}/{settings.temperature}")
        length = rng.randint(1, settings.max_tokens)
        tokens = [rng.randrange(10, 100) for _ in range(length)]
        return [*tokens, STOP] if length < settings.max_tokens else tokens

    def generate(self, prompts, settings, num_samples=1, programs=None, constraints=None) -> Iterator[Step]:
        assert num_samples == 1
        self.batch_sizes.append(len(prompts))
        plans = [self.plan(p, s) for p, s in zip(prompts, settings, strict=True)]
        info = PromptInfo(rows=len(prompts), prompt_tokens=tuple(len(p) for p in prompts), prefill_seconds=0.5)
        for index in range(max(map(len, plans))):
            if index == 2 and any(POISON in p and len(plan) > 2 for p, plan in zip(prompts, plans, strict=True)):
                raise ContextOverflowError("the prompt does not fit", hint="shorten it")
            events = []
            for row, plan in enumerate(plans):
                if index < len(plan):
                    last = index == len(plan) - 1
                    token = plan[index]
                    events.append(
                        TokenEvent(
                            row=row,
                            token=token,
                            forced=token % 2 == 0,
                            text="<|assistant_end|>" if token == STOP else f"t{token} ",
                            special=token == STOP,
                            computed=(True, token % 3 == 0),
                            finish_reason=("stop" if token == STOP else "length") if last else None,
                        )
                    )
            active = sum(len(plan) > index + 1 for plan in plans)
            yield Step(
                index=index, tokens=tuple(events), seconds=0.01, active_rows=active, prompt=info if index == 0 else None
            )


class Preparer:
    """Prompts are lists of ints in the text itself; program "missing" does not exist."""

    def prompt_ids(self, request: LineRequest) -> list[int]:
        return json.loads(request.prompt)

    def program(self, name: str) -> str:
        if name == "missing":
            raise ProgramError(f"no program named {name!r}", hint="use chat, think, calc or json")
        return name

    def constraint(self, request: LineRequest) -> str:
        return request.regex or ""


class ListSink:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        self.records.append(json.loads(json.dumps(record)))  # exactly what a JSON line round trip gives

    def close(self) -> None:
        pass


def _line(request_id: object, prompt: list[int], **fields: object) -> str:
    return json.dumps({"id": request_id, "prompt": json.dumps(prompt), **fields})


def _run(
    lines: list[str],
    *,
    batch_size: int = 4,
    ordered: bool = False,
    existing: ExistingOutput | None = None,
    defaults: BatchDefaults | None = None,
    engine: ScriptedEngine | None = None,
):
    sink = ListSink()
    summary = run_batch(
        engine or ScriptedEngine(),
        Preparer(),
        lines,
        defaults or BatchDefaults(settings=GenerationSettings(max_tokens=6)),
        sink,
        options=BatchOptions(batch_size=batch_size, ordered=ordered),
        existing=existing,
    )
    return sink.records, summary


def _without_timings(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in record.items() if k != "timings"} for record in records]


LINES = [_line(i, [i, i + 1], samples=1 + i % 3, seed=i) for i in range(10)]


def test_every_line_and_sample_gets_exactly_one_record() -> None:
    records, summary = _run(LINES)
    pairs = sorted((r["id"], r["sample"]) for r in records)
    assert pairs == sorted((i, s) for i in range(10) for s in range(1 + i % 3))
    assert summary.lines_ok == 10 and summary.lines_failed == 0 and summary.exit_code == 0
    assert summary.records == len(records)
    assert summary.tokens == sum(len(r["tokens"]) for r in records)


def test_rows_are_batched_up_to_the_batch_size() -> None:
    engine = ScriptedEngine()
    _run(LINES, batch_size=8, engine=engine)
    assert engine.batch_sizes == [8, 8, 3]  # 19 rows: samples 1, 2, 3, 1, 2, 3, ...


def test_records_do_not_depend_on_the_batch_size() -> None:
    key = lambda r: (r["id"], r["sample"])  # noqa: E731
    one, _ = _run(LINES, batch_size=1)
    many, _ = _run(LINES, batch_size=8)
    assert sorted(_without_timings(one), key=key) == sorted(_without_timings(many), key=key)


def test_samples_are_rows_with_their_own_seeds() -> None:
    records, _ = _run([_line("a", [5], samples=3, seed=9, temperature=1.0)])
    expected = [
        ScriptedEngine.plan([5], GenerationSettings(max_tokens=6, seed=sample_seed(9, s), temperature=1.0))
        for s in range(3)
    ]
    assert [r["tokens"] for r in sorted(records, key=lambda r: r["sample"])] == expected


def test_unordered_output_follows_finish_order_and_ordered_restores_input_order() -> None:
    unordered, _ = _run(LINES, batch_size=20)
    ordered, _ = _run(LINES, batch_size=20, ordered=True)
    input_order = [(i, s) for i in range(10) for s in range(1 + i % 3)]
    assert [(r["id"], r["sample"]) for r in unordered] != input_order
    assert [(r["id"], r["sample"]) for r in ordered] == input_order
    # Both runs produced the same set of records.
    assert sorted(json.dumps(r, sort_keys=True) for r in _without_timings(unordered)) == sorted(
        json.dumps(r, sort_keys=True) for r in _without_timings(ordered)
    )


def test_a_record_has_every_field() -> None:
    (record,) = _run([_line("x", [1, 2, 3], max_tokens=50, seed=1)])[0]
    plan = ScriptedEngine.plan([1, 2, 3], GenerationSettings(max_tokens=50, seed=1))
    assert record["id"] == "x" and record["sample"] == 0
    assert record["tokens"] == plan
    assert record["forced"] == [t % 2 == 0 for t in plan]
    assert record["tags"] == [[] for _ in plan]
    assert record["tool_calls"] == []
    assert record["finish_reason"] == "stop"
    # The final stop token ends the answer; it is not part of its text.
    assert record["text"] == "".join(f"t{t} " for t in plan[:-1])
    assert record["routing"] == {"1": 1.0, "3": pytest.approx(sum(t % 3 == 0 for t in plan) / len(plan), abs=1e-6)}
    assert record["timings"]["prefill_s"] == 0.5
    assert record["timings"]["decode_s"] == pytest.approx(0.01 * len(plan))
    assert record["timings"]["tokens_per_s"] == pytest.approx(len(plan) / (0.01 * len(plan)), rel=1e-3)


def test_a_row_that_fails_mid_batch_is_isolated_to_its_line() -> None:
    lines = [*LINES[:4], _line("bad", [POISON], max_tokens=6, seed=4), *LINES[4:8]]
    engine = ScriptedEngine()
    records, summary = _run(lines, batch_size=16, engine=engine, ordered=True)
    errors = [r for r in records if "finish_reason" not in r]
    good, _ = _run(LINES[:8], batch_size=16, ordered=True)
    assert _without_timings([r for r in records if "finish_reason" in r]) == _without_timings(good)
    assert errors == [{"id": "bad", "line": 5, "sample": 0, "error": "the prompt does not fit; fix: shorten it"}]
    assert summary.lines_failed == 1 and summary.lines_ok == 8 and summary.exit_code == 1


def test_isolation_bisects_so_healthy_rows_stay_batched() -> None:
    lines = [_line(i, [i], max_tokens=6, seed=i) for i in range(15)]
    lines.insert(9, _line("bad", [POISON], max_tokens=6, seed=4))
    engine = ScriptedEngine()
    records, _ = _run(lines, batch_size=16, engine=engine)
    assert [r["id"] for r in records if "finish_reason" not in r] == ["bad"]
    assert len(records) == 16
    # 16 rows, one bad: the failed call, then at most two calls per halving (8, 4, 2, 1) instead of 15 singles.
    assert len(engine.batch_sizes) <= 9
    assert sorted(engine.batch_sizes, reverse=True)[1] >= 4


def test_bad_lines_become_error_records_in_place_and_the_run_goes_on() -> None:
    lines = [LINES[0], "{oops", _line("p", [1], program="missing"), "", LINES[1]]
    records, summary = _run(lines, ordered=True)
    assert [(r.get("line"), r["id"]) for r in records] == [(None, 0), (2, None), (3, "p"), (None, 1), (None, 1)]
    assert records[1]["error"].startswith("invalid JSON")
    assert records[2]["error"] == "no program named 'missing'; fix: use chat, think, calc or json"
    assert summary.lines_ok == 2 and summary.lines_failed == 2 and summary.exit_code == 1


def test_resume_skips_done_samples_and_repeats_no_known_error() -> None:
    lines = [*LINES[:3], "{oops"]
    first, _ = _run(lines)
    done = {(json.dumps(r["id"]), r["sample"]) for r in first if "finish_reason" in r}
    # Pretend the run was killed after line 0 and one sample of line 2 were written, and the error record.
    kept = {(k, s) for k, s in done if k == "0" or (k == "2" and s == 1)}
    existing = ExistingOutput(
        done=kept,
        errors={
            (
                4,
                None,
                "invalid JSON: Expecting property name enclosed in double quotes (column 2); "
                'fix: write each line as one JSON object, e.g. {"id": 1, "prompt": "Hi"}',
            )
        },
    )
    rest, summary = _run(lines, existing=existing)
    assert sorted((r["id"], r["sample"]) for r in rest) == [(1, 0), (1, 1), (2, 0), (2, 2)]
    assert summary.lines_skipped == 1 and summary.lines_ok == 2 and summary.lines_failed == 1
    assert summary.exit_code == 1  # the bad line is still bad


@given(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 8)), min_size=1, max_size=6), st.integers(1, 5))
def test_any_resume_point_completes_every_pair_exactly_once(lines_spec: list[tuple[int, int]], cut: int) -> None:
    lines = [_line(i, [i], samples=n, max_tokens=m, seed=i) for i, (n, m) in enumerate(lines_spec)]
    first, _ = _run(lines, batch_size=3)
    head = first[: cut % (len(first) + 1)]
    existing = ExistingOutput(done={(json.dumps(r["id"]), r["sample"]) for r in head})
    rest, _ = _run(lines, batch_size=3, existing=existing)
    pairs = [(r["id"], r["sample"]) for r in head + rest]
    assert sorted(pairs) == sorted((i, s) for i, (n, _) in enumerate(lines_spec) for s in range(n))


def test_tool_events_pair_calls_with_their_outcomes() -> None:
    reply = Reply()
    events = [
        TokenEvent(
            row=0,
            token=5,
            forced=False,
            text="<|python_end|>",
            special=True,
            tool=ToolEvent("call", "calculator", "1+1"),
        ),
        TokenEvent(
            row=0,
            token=6,
            forced=True,
            text="<|output_start|>",
            special=True,
            tool=ToolEvent("result", "calculator", "1+1", "2"),
        ),
        TokenEvent(row=0, token=5, forced=False, text="", tool=ToolEvent("call", "calculator", "1/0")),
        TokenEvent(
            row=0, token=6, forced=True, text="", tool=ToolEvent("refusal", "calculator", "1/0", "division by zero")
        ),
        TokenEvent(row=0, token=7, forced=False, text="!", finish_reason="length"),
    ]
    for event in events:
        reply.add(event)
    record = row_record(reply, "t", 0)
    assert record["tool_calls"] == [
        {"tool": "calculator", "expression": "1+1", "result": "2"},
        {"tool": "calculator", "expression": "1/0", "refusal": "division by zero"},
    ]
    assert record["text"] == "<|python_end|><|output_start|>!"  # only a final *stop* token is dropped
    assert record["routing"] == {}


def test_sample_seed_keeps_sample_zero_and_separates_the_rest() -> None:
    assert sample_seed(42, 0) == 42
    seeds = {sample_seed(seed, sample) for seed in range(50) for sample in range(1, 50)}
    assert len(seeds) == 49 * 50
    assert all(0 <= s < 2**63 for s in seeds)
