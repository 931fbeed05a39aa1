"""A second tool is one file plus registration: `SHOUT` below shares the model's tool markers with a name prefix,
and runs through the engine's dispatch, the reply fold, the transcript, the history and the batch records with no
edit to engine, UI or batch code. A TTFA program forces the call, so it happens deterministically on a random model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app as cli
from chatapp.settings import GenerationSettings
from chatapp.tools import TOOLS, FunctionTool, ToolResult
from chatapp.ttfa import load_program
from chatapp.ui import make_app
from chatapp.ui.backend import EngineBackend
from chatapp.ui.history import HistoryStore
from chatapp.ui.widgets.transcript import ToolCallBlock
from tests.ui.conftest import SIZE, FixedClock, send_and_wait

# The whole tool: a name, what it does, the prefix its calls start with, the grammar of what follows the prefix.
SHOUT = FunctionTool("shout", lambda text: ToolResult.success(text.upper()), prefix="shout:", grammar="[a-z ]+")

PROGRAM = """
name = "shout-once"
tags = ["tool", "answer"]
pad = "<|assistant_end|>"

[[zones]]
label = "call"
force = "<|python_start|>shout: hi there<|python_end|>"
budget = 0
tags = ["tool"]

[[zones]]
label = "answer"
until = "<|assistant_end|>"
tags = ["answer"]
"""
SETTINGS = GenerationSettings(max_tokens=12)
CALL = {"tool": "shout", "expression": "shout: hi there", "result": "HI THERE"}
PARTS = [{"type": "python", "text": "shout: hi there"}, {"type": "python_output", "text": "HI THERE"}]


@pytest.fixture
def shout() -> FunctionTool:
    TOOLS.register(SHOUT)
    yield SHOUT
    TOOLS.unregister(SHOUT.name)


@pytest.mark.asyncio
async def test_a_second_tool_works_end_to_end(shout, routed_model_dir: Path, tmp_path: Path) -> None:
    program_file = tmp_path / "shout.toml"
    program_file.write_text(PROGRAM, encoding="utf-8")
    backend = EngineBackend.load(routed_model_dir, device="cpu")
    backend.configure(SETTINGS, None)
    engine = backend._engine

    # The engine dispatches the call by its prefix; the reply fold makes it content parts.
    program = load_program(program_file, engine.tokenizer, engine.chat_format.program_aliases)
    prompt = engine.chat_format.render_for_completion([{"role": "user", "content": "hi"}])
    [reply] = engine.generate_batch([prompt], SETTINGS, programs=[program])
    assert reply.tool_calls == [CALL]
    assert reply.content[:2] == PARTS

    # The transcript shows it as a tool block titled by the tool's renderer; the history stores what was shown.
    backend.switch_program(str(program_file))
    tui = make_app(backend=backend, db_path=tmp_path / "h.sqlite3", clock=FixedClock(), cursor_blink=False)
    async with tui.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        answer = tui.transcript.answers()[-1]
        title = str(answer.query_one(ToolCallBlock).title)
    assert [segment.kind for segment in answer.segments][:1] == ["tool"]
    assert title == "shout: hi there = HI THERE"
    store = HistoryStore(tmp_path / "h.sqlite3")
    (conversation,) = store.list_conversations()
    stored = store.load(conversation.id).messages[-1]
    assert stored.content == answer.reply.content == reply.content

    # The batch records list the call too.
    line = json.dumps({"id": "a", "prompt": "hi", "max_tokens": SETTINGS.max_tokens})
    args = ["batch", "-", "--model", str(routed_model_dir), "--program", str(program_file)]
    result = CliRunner().invoke(cli, args, input=line + "\n")
    assert result.exit_code == 0, result.output
    (record,) = [json.loads(text) for text in result.stdout.splitlines() if text]
    assert record["tool_calls"] == [CALL]


def test_a_call_with_no_matching_prefix_goes_to_the_default_tool(shout) -> None:
    from chatapp.engine.tools import ToolBox

    box = ToolBox(TOOLS, {"<|python_start|>": 1, "<|python_end|>": 2, "<|output_start|>": 3,
                          "<|output_end|>": 4}.get, lambda text: [], lambda ids: "")  # fmt: skip
    bound = box.by_start[1]
    assert [tool.name for tool in bound.tools] == ["calculator", "shout"]
    assert bound.pick("shout: abc") == (SHOUT, "abc")
    assert bound.pick(" 3*4")[0].name == "calculator"
    assert bound.grammar is not None and "shout:" in bound.grammar
