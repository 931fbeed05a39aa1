"""The CLI, the batch records and the TUI fold the same answer with the same reply fold: same text, same counts,
same compute saved (issue: they used to disagree on the stop token and on what "compute saved" means)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app as cli
from chatapp.settings import GenerationSettings
from chatapp.ui import make_app
from chatapp.ui.backend import EngineBackend
from chatapp.ui.history import HistoryStore
from chatapp.ui.widgets.panels import StatsPanel
from tests.ui.conftest import SIZE, FixedClock, send_and_wait

PROMPT = "What is 37*45?"
MAX_TOKENS = 10


def _field(block: str, name: str) -> str:
    match = re.search(rf"^{name}:\s+(.*)$", block, re.MULTILINE)
    assert match, f"{name} not in {block!r}"
    return match.group(1)


@pytest.mark.asyncio
async def test_cli_batch_and_tui_report_the_same_answer_alike(routed_model_dir: Path, tmp_path: Path) -> None:
    model = str(routed_model_dir)
    quick = CliRunner().invoke(cli, ["generate", PROMPT, "--model", model, "--max-tokens", str(MAX_TOKENS), "-v"])
    assert quick.exit_code == 0, quick.output
    line = json.dumps({"id": "a", "prompt": PROMPT, "max_tokens": MAX_TOKENS})
    batch = CliRunner().invoke(cli, ["batch", "-", "--model", model], input=line + "\n")
    assert batch.exit_code == 0, batch.output
    (record,) = [json.loads(text) for text in batch.stdout.splitlines() if text]

    backend = EngineBackend.load(routed_model_dir, device="cpu")
    backend.configure(GenerationSettings(max_tokens=MAX_TOKENS), None)
    tui = make_app(backend=backend, db_path=tmp_path / "h.sqlite3", clock=FixedClock(), cursor_blink=False)
    async with tui.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, PROMPT)
        answer = tui.transcript.answers()[-1]
        events = answer.events
        shown = answer.reply.content
        panel = str(tui.query_one(StatsPanel).render())
    (conversation,) = HistoryStore(tmp_path / "h.sqlite3").list_conversations()
    stored = HistoryStore(tmp_path / "h.sqlite3").load(conversation.id).messages[-1]
    [direct] = backend._engine.generate_batch(
        [backend._engine.chat_format.render_for_completion([{"role": "user", "content": PROMPT}])],
        GenerationSettings(max_tokens=MAX_TOKENS),
    )

    # The reply: the pipe gets exactly the record's text, and the TUI stores the message it showed, which is the
    # engine's own fold of the same tokens (one fold: the TUI does not rebuild it).
    assert quick.stdout == record["text"]
    assert stored.content == shown == direct.content == record["text"]
    assert [e.token for e in stored.tokens] == [e.token for e in events] == record["tokens"]

    # The numbers: emitted tokens, forced share, compute saved over the reply's decoder-layer work.
    tokens, forced = len(record["tokens"]), sum(record["forced"])
    num_layers = backend.info.num_layers
    saved = sum(1 - fraction for fraction in record["routing"].values()) / num_layers
    assert 0 < saved < 1  # the routed model skips some blocks, so the comparison means something
    verbose = quick.stderr
    assert _field(verbose, "eval count") == f"{tokens} token(s)"
    assert _field(verbose, "forced tokens") == (f"{forced} ({forced / tokens:.1%})" if tokens else "0")
    assert _field(verbose, "compute saved").startswith(f"{saved:.1%} ")
    assert re.search(rf"tokens\s+{tokens}\s", panel)
    assert re.search(rf"forced\s+{forced / tokens:.0%}", panel)
    assert re.search(rf"compute saved\s+{saved:.0%}", panel)


@pytest.mark.asyncio
async def test_cli_batch_and_tui_report_the_same_logprobs(routed_model_dir: Path, tmp_path: Path) -> None:
    """Log-probabilities, surprise and alternatives come through the one fold: the `--logprobs` table, the batch
    record's OpenAI-shaped `logprobs` and the TUI's events carry the same numbers for the same answer."""
    model, n = str(routed_model_dir), 3
    args = ["generate", PROMPT, "--model", model, "--max-tokens", str(MAX_TOKENS), "--logprobs", str(n)]
    quick = CliRunner().invoke(cli, args)
    assert quick.exit_code == 0, quick.output
    line = json.dumps({"id": "a", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "logprobs": n})
    batch = CliRunner().invoke(cli, ["batch", "-", "--model", model], input=line + "\n")
    assert batch.exit_code == 0, batch.output
    (record,) = [json.loads(text) for text in batch.stdout.splitlines() if text]

    backend = EngineBackend.load(routed_model_dir, device="cpu")
    backend.configure(GenerationSettings(max_tokens=MAX_TOKENS, logprobs=n), None)
    tui = make_app(backend=backend, db_path=tmp_path / "h.sqlite3", clock=FixedClock(), cursor_blink=False)
    async with tui.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, PROMPT)
        events = tui.transcript.answers()[-1].events
        panel = str(tui.query_one(StatsPanel).render())

    content = record["logprobs"]["content"]
    reply_events = events[: len(content)]
    assert [e.token for e in events] == record["tokens"]
    for event, entry in zip(reply_events, content, strict=True):
        assert event.logprobs is not None
        assert event.logprobs.logprob == pytest.approx(entry["logprob"], abs=1e-5)
        assert [list(a.piece) for a in event.logprobs.top] == [alt["bytes"] for alt in entry["top_logprobs"]]
        assert [a.logprob for a in event.logprobs.top] == pytest.approx(
            [alt["logprob"] for alt in entry["top_logprobs"]], abs=1e-5
        )
    # The table prints each emitted token's logprob to 3 decimals, in order.
    printed = re.findall(r"^\s*(\d+)\s.*?\s(-?\d+\.\d{3})\s+(\d\.\d{3})\s", quick.stderr, re.MULTILINE)
    assert [float(value) for _, value, _ in printed][: len(content)] == pytest.approx(
        [round(entry["logprob"], 3) for entry in content], abs=1.1e-3
    )
    surprise = sum(-e.logprobs.logprob for e in events) / len(events)
    assert re.search(rf"surprise\s+{surprise:.2f}", panel)
