"""The shape every refused command has, checked the same way by the hostile suites."""

from __future__ import annotations

from typer.testing import CliRunner

from chatapp.cli import app

runner = CliRunner()


def refused(args: list[str], *messages: str) -> str:
    """The command exits 1 with exactly one `error:` and one `fix:` line, no traceback, no usage box, and says each
    of `messages` (matched with the output's line wrapping undone)."""
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output and "Usage:" not in result.output and "╭" not in result.output
    assert result.output.count("error:") == 1 and result.output.count("fix:") == 1, result.output
    for message in messages:
        assert message in " ".join(result.output.split()), result.output
    return result.output
