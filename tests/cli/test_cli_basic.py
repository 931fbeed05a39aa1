"""The basic CLI commands: help, version, info, calc."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from chatapp import __version__
from chatapp.cli import app
from chatapp.models import default_model_dir
from chatapp.settings import config_dir, data_dir, history_db_path

runner = CliRunner()


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "info" in result.output and "calc" in result.output


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"chatapp {__version__}"


def test_info_shows_versions_device_and_locations():
    import torch

    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    rows = dict(line.split(":", 1) for line in result.output.splitlines())
    rows = {key: value.strip() for key, value in rows.items()}
    assert rows["chatapp"] == __version__
    assert rows["torch"] == torch.__version__
    assert rows["transformers"][0].isdigit() and rows["textual"][0].isdigit()
    expected_device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    assert rows["device"].startswith(expected_device)
    # Locations follow CHATAPP_HOME (set per test by conftest), not the real home.
    assert rows["config dir"] == str(config_dir())
    assert rows["data dir"] == str(data_dir())
    assert rows["history db"] == str(history_db_path())
    assert rows["default model"].startswith(str(default_model_dir()))
    assert rows["default model"].endswith(("(present)", "(missing)"))


@pytest.mark.parametrize(
    ("args", "output"),
    [
        (["37*45"], "1665"),
        (["0.2*50"], "10"),
        (["7/2"], "3.5"),
        (['"strawberry".count("r")'], "3"),
        (["--", "-7//2"], "-4"),
    ],
)
def test_calc_prints_the_value(args: list[str], output: str):
    result = runner.invoke(app, ["calc", *args])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == output


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("1/0", "division by zero"),
        ("2**10", "'**' (power) is not allowed"),
        ('"abc"[0]', "Subscript expressions are not allowed"),
        ("__import__('os')", "function calls are not allowed"),
    ],
)
def test_calc_refusal_names_the_expression_and_why(expression: str, reason: str):
    result = runner.invoke(app, ["calc", expression])
    assert result.exit_code == 1
    assert result.stdout == ""
    message = " ".join(result.stderr.split())  # undo Rich's wrapping
    assert f"the calculator refused {expression!r}" in message
    assert reason in message
    assert "Traceback" not in result.output


def test_models_lists_the_registered_names_and_the_default() -> None:
    from chatapp.models import resolve_model

    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 0, result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("tiny ")]
    assert str(resolve_model("tiny")) in line and "(default)" in line
