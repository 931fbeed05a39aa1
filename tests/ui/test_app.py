"""Headless Pilot tests of the chat app driven by the scripted backend."""

from __future__ import annotations

import json
import time

import pytest
from textual.widgets import OptionList

from chatapp.engine.reply import Reply
from chatapp.errors import ContextOverflowError
from chatapp.settings import data_dir
from chatapp.ui.history import HistoryStore
from chatapp.ui.screens.program import ProgramScreen
from chatapp.ui.screens.settings import SettingsScreen
from chatapp.ui.widgets.heatmap import RoutingHeatmap
from chatapp.ui.widgets.panels import StatsPanel, TokenInspector, ZonePills
from chatapp.ui.widgets.prompt import PromptInput
from chatapp.ui.widgets.transcript import AssistantMessage, ToolCallBlock, UserMessage
from tests.ui.conftest import SIZE, send_and_wait, submit, wait_until
from tests.ui.scripted import ScriptedBackend, calculator_answer, greeting, think_answer

pytestmark = pytest.mark.asyncio


def _texts(app) -> list[tuple[str, str]]:
    """The transcript as (role, text) pairs."""
    out = []
    for widget in app.transcript.children:
        if isinstance(widget, UserMessage):
            out.append(("user", widget.text))
        elif isinstance(widget, AssistantMessage):
            out.append(("assistant", Reply.of(widget.events).content))
    return out


async def test_send_streams_every_token_and_saves(build_app, tmp_path):
    backend = ScriptedBackend([greeting()], delay=0.004)
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        assert backend.calls == [("send", "hi")]
        assert _texts(app) == [("user", "hi"), ("assistant", "Hello! How can I help you today?")]
        answer = app.transcript.answers()[-1]
        assert answer.events == greeting()
        assert answer.status == "complete"
        assert app.query_one(PromptInput).text == ""
    conversation = HistoryStore(tmp_path / "history.sqlite3").load(1)
    assert conversation.summary.title == "hi"
    assert [m.status for m in conversation.messages] == ["complete", "complete"]
    assert conversation.messages[1].tokens == greeting()


async def test_tokens_arrive_in_batches_not_per_token(build_app):
    """A long fast answer reaches the UI in about 30 batches per second, not one message per token."""
    long_answer = greeting() * 40
    backend = ScriptedBackend([long_answer], delay=0.0005)
    app = build_app(backend)
    batches = []
    original = app._apply

    def counting_apply(generation, steps, **options):
        batches.append(len(steps))
        return original(generation, steps, **options)

    app._apply = counting_apply
    async with app.run_test(size=SIZE) as pilot:
        started = time.monotonic()
        await send_and_wait(pilot, "go")
        elapsed = time.monotonic() - started
        assert app.transcript.answers()[-1].events == long_answer
        assert sum(batches) == len(long_answer)
        assert len(batches) <= elapsed * 30 + 2
        assert len(batches) < len(long_answer) / 2


async def test_tokens_before_a_stall_are_shown_during_it(build_app):
    """The generator produces 20 tokens at once, then stalls (a slow tool, a long prefill): the 20 are on screen
    within a few frames, not when the next token comes."""
    backend = ScriptedBackend([greeting() * 4])
    backend.hold_after = 20
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await submit(pilot, "hi")
        await wait_until(pilot, backend.held.is_set)
        started = time.monotonic()
        await wait_until(pilot, lambda: len(app.transcript.answers()[-1].events) == 20, timeout=2, what="20 tokens")
        assert time.monotonic() - started < 1
        # The stats text, updated a few times a second, catches up too.
        stats = app.query_one(StatsPanel)
        await wait_until(pilot, lambda: "tokens        20 " in str(stats.render()), timeout=2, what="stats")
        backend.release.set()
        await wait_until(pilot, lambda: not app.is_generating)
        assert app.transcript.answers()[-1].events == greeting() * 4


async def test_escape_cancels_and_keeps_the_partial_answer(build_app, tmp_path):
    backend = ScriptedBackend([greeting()])
    backend.hold_after = 3
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.click("#prompt")
        app.query_one(PromptInput).insert("hi")
        await pilot.press("enter")
        await wait_until(pilot, backend.held.is_set, what="the stream to reach the hold")
        assert app.is_generating
        await pilot.press("escape")
        backend.release.set()
        await wait_until(pilot, lambda: not app.is_generating, what="cancellation")
        answer = app.transcript.answers()[-1]
        # The step in flight when Esc was pressed still arrives; nothing after it is generated.
        assert answer.events == greeting()[:4]
        assert answer.status == "interrupted"
        assert backend.cancelled == 1
    message = HistoryStore(tmp_path / "history.sqlite3").load(1).messages[1]
    assert message.status == "interrupted"
    assert message.content == "Hello! How can"


async def test_kill_mid_answer_loses_nothing_shown(build_app, tmp_path):
    """Everything on screen is already in the database while the answer is still streaming."""
    backend = ScriptedBackend([greeting()], delay=0.02)
    backend.hold_after = 6
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.click("#prompt")
        app.query_one(PromptInput).insert("hi")
        await pilot.press("enter")
        await wait_until(pilot, backend.held.is_set, what="the hold")
        await pilot.pause()
        shown = list(app.transcript.answers()[-1].events)
        assert shown, "some tokens should be on screen before the hold"
        stored = HistoryStore(tmp_path / "history.sqlite3").load(1).messages[1]
        assert stored.status == "interrupted"  # still `streaming` on disk: what a restart would see
        assert stored.tokens[: len(shown)] == shown
        backend.release.set()
        await wait_until(pilot, lambda: not app.is_generating)


async def test_a_refused_turn_changes_nothing(build_app, tmp_path):
    """A turn the backend refuses up front (full context) is reported; the message stays in the input."""
    backend = ScriptedBackend([greeting()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        backend.refuse = ContextOverflowError("this turn needs 2100 tokens of context but the model holds 2048")
        await submit(pilot, "a very long message")
        await pilot.pause()
        assert _texts(app) == [("user", "hi"), ("assistant", "Hello! How can I help you today?")]
        assert app.query_one(PromptInput).text == "a very long message"
        assert any("2100 tokens" in n.message for n in app._notifications)
        backend.refuse = ContextOverflowError("full")
        await pilot.press("ctrl+r")
        await pilot.pause()
        assert len(app.transcript.answers()) == 1 and backend.calls == [("send", "hi")]
    assert len(HistoryStore(tmp_path / "history.sqlite3").load(1).messages) == 2


async def test_regenerate_replaces_the_last_answer(build_app, tmp_path):
    backend = ScriptedBackend([greeting(), think_answer()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: backend.calls[-1] == ("regenerate", None))
        await wait_until(pilot, lambda: not app.is_generating)
        await pilot.pause()
        assert _texts(app) == [("user", "hi"), ("assistant", Reply.of(think_answer()).content)]
    messages = HistoryStore(tmp_path / "history.sqlite3").load(1).messages
    assert [(m.role, m.content) for m in messages] == [("user", "hi"), ("assistant", Reply.of(think_answer()).content)]


async def test_edit_last_message_and_resend(build_app, tmp_path):
    backend = ScriptedBackend([greeting(), calculator_answer()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "what is 37*44?")
        await pilot.press("ctrl+e")
        prompt = app.query_one(PromptInput)
        assert prompt.text == "what is 37*44?" and app.editing
        await pilot.press("backspace", "backspace", "5", "?", "enter")
        await wait_until(pilot, lambda: not app.is_generating and backend.calls[-1][0] == "edit_last")
        await pilot.pause()
        assert backend.calls[-1] == ("edit_last", "what is 37*45?")
        assert _texts(app) == [("user", "what is 37*45?"), ("assistant", Reply.of(calculator_answer()).content)]
        assert not app.editing
    messages = HistoryStore(tmp_path / "history.sqlite3").load(1).messages
    assert [m.content for m in messages] == ["what is 37*45?", Reply.of(calculator_answer()).content]


async def test_tool_call_is_a_collapsible_block(build_app):
    app = build_app(ScriptedBackend([calculator_answer()]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "what is 37*45?")
        (block,) = app.query(ToolCallBlock)
        assert block.collapsed
        assert block.title == "calculator: 37*45 = 1665"
        await pilot.click(block.query_one("CollapsibleTitle"))
        await pilot.pause()
        assert not block.collapsed
        outcome = block.query_one(".tool-outcome")
        assert "result: 1665" in str(outcome.render())
        # Prose before and after the call stays outside the block.
        answer = app.transcript.answers()[-1]
        assert [s.kind for s in answer.segments] == ["text", "tool", "text"]


async def test_refused_tool_call_shows_the_reason(build_app):
    events = [
        e if e.tool is None or e.tool.kind == "call" else type(e)(**{**{n: getattr(e, n) for n in e.__slots__},
                                                                  "tool": type(e.tool)("refusal", "calculator", "37*45", "too big")})
        for e in calculator_answer()
    ]  # fmt: skip
    app = build_app(ScriptedBackend([events]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "x")
        (block,) = app.query(ToolCallBlock)
        assert block.title == "calculator: 37*45  ✗ refused"
        assert block.has_class("-refused")


async def test_click_and_keyboard_select_tokens(build_app):
    app = build_app(ScriptedBackend([think_answer()]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "capital?")
        answer = app.transcript.answers()[-1]
        run = answer.query("TokenRun").first()
        await pilot.click(run, offset=(0, 0))  # the first token: the forced ⟨think⟩
        await pilot.pause()
        assert answer.cursor == 0
        inspector = str(app.query_one(TokenInspector).render())
        assert "⟨think⟩" in inspector and "forced" in inspector and "id 10" in inspector
        assert "L1" in inspector and "L7" in inspector
        assert app.query_one(RoutingHeatmap).selected == 0
        answer.focus()
        await pilot.press("right", "right")
        assert answer.cursor == 2
        inspector = str(app.query_one(TokenInspector).render())
        assert "' is'" in inspector and "sampled" in inspector and "think" in inspector
        await pilot.press("end")
        assert answer.cursor == len(answer.events) - 1
        assert "not fed to the model" in str(app.query_one(TokenInspector).render())


async def test_switch_program_lights_zone_tags(build_app):
    backend = ScriptedBackend([think_answer()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        await wait_until(pilot, lambda: isinstance(app.screen, ProgramScreen))
        options = app.screen.query_one(OptionList)
        options.highlighted = [options.get_option_at_index(i).id for i in range(options.option_count)].index("think")
        await pilot.press("enter")
        await wait_until(pilot, lambda: not isinstance(app.screen, ProgramScreen))
        assert backend.program is not None and backend.program.name == "think"
        pills = app.query_one(ZonePills)
        assert pills.program == backend.program and "program: think" in app.sub_title
        await send_and_wait(pilot, "capital?")
        assert pills.active == ("answer",) and "● answer" in str(pills.render())


async def test_bad_program_file_shows_error_and_keeps_program(build_app, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("zones = [[[")
    backend = ScriptedBackend()
    backend.switch_program("calc")
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        await wait_until(pilot, lambda: isinstance(app.screen, ProgramScreen))
        await pilot.click("#program-path")
        await pilot.press(*str(bad), "enter")
        error = app.screen.query_one("#error")
        await wait_until(pilot, lambda: "is not valid TOML" in str(error.render()), what="the compile's error")
        assert error.display
        assert isinstance(app.screen, ProgramScreen)
        assert backend.program.name == "calc"


async def test_settings_are_validated_then_applied(build_app):
    """Each step waits on what the screen shows or does, never on time: under load a key press, the regex worker and
    the screen closing each take as long as they take (the waits' limits are far above any of them)."""
    backend = ScriptedBackend()
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen) and app.screen.query("#set-top_k"))
        screen = app.screen

        def error() -> str:
            shown = screen.query_one("#error")
            return str(shown.render()) if shown.display else ""

        async def fill(field: str, value: str) -> None:
            widget = screen.query_one(f"#set-{field}")
            widget.value = value
            await wait_until(pilot, lambda: widget.value == value)

        async def save(shows: str) -> None:
            """Enter in a field saves, like the Save button; then wait for what it must show."""
            # A save while a compile is running is ignored by the screen: start only once none is.
            await wait_until(pilot, lambda: screen._cancel is None, what="no compile running", timeout=120)
            field = screen.query_one("#set-temperature")
            field.focus()
            await wait_until(pilot, lambda: app.focused is field, what="the field to take focus")
            await pilot.press("enter")
            await wait_until(pilot, lambda: shows in error(), what=repr(shows), timeout=120)

        await fill("top_k", "abc")
        await save("top-k (0 = off): 'abc' is not a whole number")
        await fill("top_k", "40")
        await fill("top_p", "1.5")
        await save("top_p must be in (0, 1]")
        await fill("top_p", "0.9")
        await fill("constraint", "[a-z")
        await save("'[a-z'")  # compiled in a worker; its first compile imports the trie package
        assert backend.settings.top_k == 0  # nothing applied while invalid
        await fill("constraint", "[a-z]+")
        await fill("temperature", "0.7")
        await fill("routing_threshold", "0.25")
        await wait_until(pilot, lambda: screen._cancel is None, what="no compile running", timeout=120)
        assert await pilot.click("#save"), "the click did not land on Save"
        await wait_until(
            pilot, lambda: not isinstance(app.screen, SettingsScreen), what="the screen to close", timeout=120
        )
        s = backend.settings
        assert (s.temperature, s.top_k, s.top_p, s.routing_threshold) == (0.7, 40, 0.9, 0.25)
        assert backend.constraint == "[a-z]+"


async def test_a_slow_regex_compiles_off_the_ui_thread_and_esc_cancels_it(build_app, monkeypatch):
    """Issue 17: F2 with `c{2500}` froze the UI (and ctrl+q) while the regex compiled on the UI thread. The compile
    here blocks until the test releases it, so the test does not depend on how fast this machine compiles."""
    import threading

    import chatapp.trie.regex

    release = threading.Event()
    real = chatapp.trie.regex.compile_regex

    def slow_compile(pattern: str):
        release.wait(10)
        return real(pattern)

    monkeypatch.setattr(chatapp.trie.regex, "compile_regex", slow_compile)
    backend = ScriptedBackend()
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f2")
        await wait_until(pilot, lambda: isinstance(app.screen, SettingsScreen) and app.screen.query("#set-constraint"))
        screen = app.screen
        screen.query_one("#set-constraint").value = "c{25}"
        screen.query_one("#set-temperature").focus()
        started = time.monotonic()
        await pilot.press("enter")
        assert "compiling" in str(screen.query_one("#error").render())  # the UI thread is not compiling
        await pilot.press("escape")  # handled at once: the UI thread is free
        await wait_until(pilot, lambda: not isinstance(app.screen, SettingsScreen), timeout=5)
        assert time.monotonic() - started < 5
        release.set()  # the compile finishes after the cancel: nothing may be applied
        await pilot.pause(0.3)
        assert backend.constraint is None


async def test_export_writes_markdown_and_json(build_app):
    app = build_app(ScriptedBackend([calculator_answer()]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "what is 37*45?")
        await pilot.press("ctrl+s")
        await pilot.pause()
    exports = sorted((data_dir() / "exports").iterdir())
    assert [p.suffix for p in exports] == [".json", ".md"]
    assert "```python\n37*45\n```" in exports[1].read_text()
    data = json.loads(exports[0].read_text())
    assert data["messages"][0]["content"] == "what is 37*45?"
    assert sum(t["forced"] for t in data["messages"][1]["tokens"]) == sum(e.forced for e in calculator_answer())


async def test_copy_last_answer(build_app):
    app = build_app(ScriptedBackend([greeting()]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        await pilot.press("ctrl+y")
        assert app.clipboard == "Hello! How can I help you today?"


async def test_history_resume_rename_delete(build_app, tmp_path):
    db = tmp_path / "shared.sqlite3"
    first = build_app(ScriptedBackend([calculator_answer()]), db=db)
    async with first.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "what is 37*45?")
        shown = list(first.transcript.answers()[-1].events)
    other = HistoryStore(db, clock=lambda: 1.0)  # long before the chat above
    other.create_conversation("an older chat")
    other.close()

    backend = ScriptedBackend([greeting()])
    app = build_app(backend, db=db)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await wait_until(pilot, lambda: app.screen.query("#conversations"))
        options = app.screen.query_one(OptionList)
        assert options.option_count == 2
        # Rename the highlighted (most recent) conversation, then delete the other one.
        await pilot.press("r")
        rename = app.screen.query_one("#rename")
        rename.value = "multiplication"
        await pilot.press("enter")
        await pilot.press("down", "d")
        assert [s.title for s in app.store.list_conversations()] == ["multiplication"]
        await pilot.press("up", "enter")
        await wait_until(pilot, lambda: app.conversation_id is not None and app.transcript.answers())
        assert app.transcript.answers()[-1].events == shown
        assert backend.sessions[-1] == [
            {"role": "user", "content": "what is 37*45?"},
            {"role": "assistant", "content": Reply.of(calculator_answer()).content},
        ]
        # The resumed conversation goes on where it stopped.
        await send_and_wait(pilot, "thanks")
        assert [role for role, _ in _texts(app)] == ["user", "assistant", "user", "assistant"]
    assert len(HistoryStore(db).load(1).messages) == 4


async def test_prompt_history_up_down(build_app):
    app = build_app(ScriptedBackend([greeting()]))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "first")
        await send_and_wait(pilot, "second")
        prompt = app.query_one(PromptInput)
        prompt.focus()
        prompt.insert("draft")
        await pilot.press("up")
        assert prompt.text == "second"
        await pilot.press("up", "up")
        assert prompt.text == "first"
        await pilot.press("down")
        assert prompt.text == "second"
        await pilot.press("down")
        assert prompt.text == "draft"


async def test_ctrl_j_inserts_newline_enter_sends(build_app):
    backend = ScriptedBackend([greeting()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.click("#prompt")
        await pilot.press("a", "ctrl+j", "b")
        assert app.query_one(PromptInput).text == "a\nb"
        await pilot.press("enter")
        await wait_until(pilot, lambda: backend.calls and not app.is_generating)
        assert backend.calls == [("send", "a\nb")]


async def test_reading_history_is_not_yanked(build_app):
    app = build_app(ScriptedBackend([greeting() * 3]))
    async with app.run_test(size=SIZE) as pilot:
        for i in range(4):
            await send_and_wait(pilot, f"message {i}")
        transcript = app.transcript
        assert transcript.max_scroll_y > 0 and transcript.is_at_bottom
        transcript.scroll_home(animate=False, immediate=True)
        await send_and_wait(pilot, "while reading")
        assert transcript.scroll_y == 0
        transcript.scroll_end(animate=False, immediate=True)
        await send_and_wait(pilot, "at the bottom")
        await pilot.pause()
        assert transcript.is_at_bottom


async def test_new_chat_starts_fresh(build_app):
    backend = ScriptedBackend([greeting()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        await pilot.press("ctrl+n")
        await wait_until(pilot, lambda: not app.transcript.answers())
        assert app.conversation_id is None and backend.sessions == [[]]
        await send_and_wait(pilot, "again")
        assert [c.title for c in app.store.list_conversations()] == ["again", "hi"]


async def test_command_palette_runs_chat_commands(build_app):
    backend = ScriptedBackend([greeting(), think_answer()])
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        await pilot.press("ctrl+p")
        await pilot.press(*"regenerate")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_until(pilot, lambda: backend.calls[-1] == ("regenerate", None) and not app.is_generating)


async def test_help_lists_keys_and_paths(build_app, tmp_path):
    app = build_app()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        await pilot.pause()
        text = str(app.screen.query_one("Static").render())
        assert str(tmp_path / "history.sqlite3") in text
        assert "ctrl+r" in text.lower() or "^r" in text
        assert "Regenerate" in text and "config" in text
        await pilot.press("escape")
        assert not app.screen.query("HelpScreen")
