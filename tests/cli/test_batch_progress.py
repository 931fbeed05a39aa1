"""The batch progress bar: drawn on an interactive stderr, absent otherwise (records and pipes stay clean)."""

from __future__ import annotations

import io

from rich.console import Console

from chatapp.batch.progress import RichProgress, progress_for
from chatapp.batch.runner import NoProgress


def test_no_bar_when_stderr_is_not_a_terminal() -> None:
    assert isinstance(progress_for(Console(file=io.StringIO())), NoProgress)


def test_the_bar_counts_lines_and_shows_tokens_per_second() -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=120)
    progress = progress_for(console)
    assert isinstance(progress, RichProgress)
    progress.start(total_lines=4)
    progress.add_tokens(30)
    progress.line_done()
    progress.line_done()
    progress.close()
    drawn = screen.getvalue()
    assert "2/4" in drawn
    assert "tokens/s" in drawn
