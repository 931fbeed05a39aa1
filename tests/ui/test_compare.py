"""Comparing an answer with its routing-off twin: the divergence index, the one-line summary, the app's flow."""

from __future__ import annotations

import pytest

from chatapp.ui.compare import Comparison, first_divergence
from chatapp.ui.screens.compare import CompareScreen
from tests.ui.conftest import SIZE, send_and_wait, wait_until
from tests.ui.scripted import ScriptedBackend, answer, greeting


def test_first_divergence_and_summary() -> None:
    routed = answer("The", " capital", " is", " Paris", ".")
    assert first_divergence(routed, routed) is None
    assert Comparison.of(routed, routed).summary == "identical (6 tokens)"
    other = answer("The", " capital", " is", " London", ".")
    comparison = Comparison.of(routed, other)
    assert comparison.divergence == 3
    assert comparison.summary == "diverges at token 3: ' Paris' vs ' London'"
    shorter = answer("The", " capital", end=False)
    assert first_divergence(routed, shorter) == 2
    assert Comparison.of(routed, shorter).summary == "diverges at token 2: ' is' vs (end)"


@pytest.mark.asyncio
async def test_f5_compares_the_last_answer_and_leaves_the_conversation_alone(build_app) -> None:
    backend = ScriptedBackend([greeting()])
    backend.compare_answer = answer("Hello", "!", " How", " may")
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        messages = list(backend.messages)
        await pilot.press("f5")
        await wait_until(pilot, lambda: isinstance(app.screen, CompareScreen), what="the compare screen")
        assert app.screen.comparison.summary == "diverges at token 3: ' can' vs ' may'"
        assert backend.calls[-1] == ("compare_last", None)
        assert backend.messages == messages  # the comparison is not a turn
        assert not app.is_generating
        await pilot.press("escape")
        assert not isinstance(app.screen, CompareScreen)


@pytest.mark.asyncio
async def test_f5_without_an_answer_says_so(build_app) -> None:
    backend = ScriptedBackend()
    app = build_app(backend)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        await pilot.pause()
        assert ("compare_last", None) not in backend.calls
