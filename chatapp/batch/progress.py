"""The progress bar of a batch run: lines done, tokens/s, ETA, on stderr, only when stderr is a terminal.

Records go to stdout (or a file) and nothing else may: a pipeline reading them must never see a progress line, and a
log file capturing stderr should not fill with redraws. So the bar exists only on an interactive stderr.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from chatapp.batch.runner import BatchProgress, NoProgress


class RichProgress:
    """A Rich bar advanced by whole lines, with a live tokens/s figure updated on every engine step."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            TextColumn("generate"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("lines"),
            TextColumn("{task.fields[rate]:>8.1f} tokens/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task("generate", total=None, rate=0.0)
        self._tokens = 0
        self._started = time.perf_counter()

    def start(self, total_lines: int) -> None:
        self._started = time.perf_counter()
        self._progress.update(self._task, total=total_lines)
        self._progress.start()

    def add_tokens(self, count: int) -> None:
        self._tokens += count
        elapsed = time.perf_counter() - self._started
        self._progress.update(self._task, rate=self._tokens / elapsed if elapsed > 0 else 0.0)

    def line_done(self) -> None:
        self._progress.advance(self._task)

    def close(self) -> None:
        self._progress.stop()


def progress_for(console: Console) -> BatchProgress:
    """A live bar when `console` (stderr) is an interactive terminal, else nothing at all."""
    if console.is_terminal and not console.is_dumb_terminal:
        return RichProgress(console)
    return NoProgress()
