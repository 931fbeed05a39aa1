"""The quick-mode stream printer: forced tokens styled apart, stats counted."""

from __future__ import annotations

from rich.console import Console

from chatapp.cli.render import stream_reply
from chatapp.settings import GenerationSettings


def test_forced_tokens_are_styled_and_counted(scripted, chat_format) -> None:
    prompt = chat_format.render_for_completion([{"role": "user", "content": "3*4?"}])
    call = [chat_format.python_start_id, *chat_format.encode_text("3*4"), chat_format.python_end_id]
    engine, _ = scripted({len(prompt) + i: t for i, t in enumerate(call)})
    console = Console(record=True, force_terminal=True, width=200)
    stats = stream_reply(engine, "3*4?", GenerationSettings(max_tokens=len(call) + 2), console, verbose=True)
    assert stats.forced_count == len(chat_format.encode_text("12")) + 2
    assert stats.emitted == len(call) + 2 + stats.forced_count
    assert stats.compute_saved == 0.0  # an untrained model routes every token
    text = console.export_text(clear=False)
    assert "<|python_start|>3*4<|python_end|><|output_start|>12<|output_end|>" in text
    assert "font-style: italic" in console.export_html(inline_styles=True)
