"""The app before its model is loaded: it draws and takes keys at once, a message sent meanwhile waits on screen and
goes when the model is ready, and a model that does not load closes the app with its error."""

from __future__ import annotations

import pytest

from chatapp.engine.reply import Reply
from chatapp.errors import ModelDirError
from chatapp.ui.screens.settings import SettingsScreen
from chatapp.ui.widgets.heatmap import RoutingHeatmap
from chatapp.ui.widgets.panels import TokenInspector
from chatapp.ui.widgets.prompt import PromptInput
from chatapp.ui.widgets.transcript import PendingMessage, UserMessage
from tests.ui.conftest import SIZE, ready, wait_until
from tests.ui.scripted import STT_LAYERS, ScriptedBackend, greeting

pytestmark = pytest.mark.asyncio


def _loading_backend() -> ScriptedBackend:
    backend = ScriptedBackend([greeting()])
    backend.loaded.clear()
    return backend


async def test_the_app_draws_and_takes_keys_while_the_model_loads_and_sends_the_message_once_it_is_ready(build_app):
    backend = _loading_backend()
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert app.loading and "loading the model" in str(app.query_one("#welcome").render())
        assert "loading the model" in app.sub_title
        prompt = app.query_one(PromptInput)
        assert app.focused is prompt
        await pilot.press(*"Hi there")  # typed, not inserted: keys reach the input from the first frame
        assert prompt.text == "Hi there"
        await pilot.press("enter")
        await pilot.pause()
        pending = app.query_one(PendingMessage)
        assert pending.text == "Hi there" and "loading the model" in str(pending.border_subtitle)
        assert backend.calls == [] and prompt.text == ""
        # Keys that need the model say it is loading, and open nothing.
        await pilot.press("f2")
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen)
        assert any("still loading" in n.message for n in app._notifications)

        backend.loaded.set()
        await wait_until(pilot, lambda: app.transcript.answers() and not app.is_generating, what="the answer")
        assert backend.calls == [("send", "Hi there")]
        assert not app.query(PendingMessage) and not app.query("#welcome")
        assert [m.text for m in app.query(UserMessage)] == ["Hi there"]
        assert Reply.of(app.transcript.answers()[0].events).content == Reply.of(greeting()).content
        # The panels show the loaded model.
        assert app.query_one(RoutingHeatmap).stt_layers == STT_LAYERS
        assert app.query_one(TokenInspector).stt_layers == STT_LAYERS
        assert app.sub_title == "scripted-8L · program: none"
        [conversation] = app.store.list_conversations()  # saved when it was sent, under the model's name
        assert (conversation.title, conversation.model, conversation.messages) == ("Hi there", "scripted-8L", 2)


async def test_a_second_message_while_loading_is_given_back(build_app):
    backend = _loading_backend()
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        prompt = app.query_one(PromptInput)
        prompt.insert("first")
        await pilot.press("enter")
        prompt.insert("second")
        await pilot.press("enter")
        await pilot.pause()
        assert [m.text for m in app.query(PendingMessage)] == ["first"]
        assert prompt.text == "second"  # nothing typed is dropped
        backend.loaded.set()
        await wait_until(pilot, lambda: app.transcript.answers() and not app.is_generating, what="the answer")
        assert backend.calls == [("send", "first")] and prompt.text == "second"


async def test_the_app_opens_without_waiting_when_the_model_is_loaded_already(build_app):
    app = build_app(ScriptedBackend())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        assert not app.loading and "scripted-8L on cpu · 8 layers, 4 STT" in str(app.query_one("#welcome").render())


async def test_a_model_that_does_not_load_closes_the_app_with_its_error(build_app):
    backend = _loading_backend()
    app = build_app(backend)
    error = ModelDirError("/models/broken has no weights", hint="copy model.safetensors into it")
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.query_one(PromptInput).insert("Hello?")
        await pilot.press("enter")
        await pilot.pause()
        backend.load_error = error
        backend.loaded.set()
        await wait_until(pilot, lambda: app.engine_error is not None, what="the load error")
    assert app.engine_error is error and app.return_code == 1
    assert app.unsent == "Hello?"  # the CLI prints it: what was typed is not lost silently
    assert backend.calls == []


async def test_quitting_while_the_model_loads_does_not_wait_for_it(build_app):
    app = build_app(_loading_backend())
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        await pilot.press("ctrl+q")
    assert app.engine_error is None and app.return_code == 0
    assert all(worker.is_finished for worker in app.workers)


async def test_the_model_may_become_ready_under_another_screen(build_app):
    backend = _loading_backend()
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await ready(pilot)
        app.query_one(PromptInput).insert("Hi")
        await pilot.press("enter", "f1")
        await wait_until(pilot, lambda: app.screen is not app.screen_stack[0], what="the help screen")
        backend.loaded.set()
        await wait_until(pilot, lambda: app.transcript.answers() and not app.is_generating, what="the answer")
        await pilot.press("escape")
        await wait_until(pilot, lambda: app.screen is app.screen_stack[0], what="the chat screen")
        assert backend.calls == [("send", "Hi")] and app.query_one(RoutingHeatmap).stt_layers == STT_LAYERS
