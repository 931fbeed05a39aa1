"""`chatapp program show` and `chatapp program check`."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app


@pytest.fixture
def tokenizer_file(tmp_path: Path, ttfa_tokenizer) -> Path:
    path = tmp_path / "tokenizer.json"
    ttfa_tokenizer.save(str(path))
    return path


def invoke(*args: str):
    return CliRunner().invoke(app, ["program", *args])


def test_show_prints_the_disassembly(tokenizer_file: Path) -> None:
    result = invoke("show", "think", "--tokenizer", str(tokenizer_file))
    assert result.exit_code == 0, result.output
    golden = (Path(__file__).with_name("goldens") / "think.txt").read_text()
    assert result.stdout == golden


def test_show_accepts_a_model_directory(tokenizer_file: Path) -> None:
    result = invoke("show", "chat", "--tokenizer", str(tokenizer_file.parent))
    assert result.exit_code == 0 and "0 answer" in result.stdout


def test_check_reports_ok_with_warnings(tmp_path: Path, tokenizer_file: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text('name = "p"\n\n[[zones]]\nlabel = "a"\nforce = "The answer is "\nuntil = "<|assistant_end|>"\n')
    result = invoke("check", str(path), "--tokenizer", str(tokenizer_file))
    assert result.exit_code == 0, result.output
    assert "ok: p (1 zones, 1 warnings)" in result.stdout
    assert f"warning: {path}:5: zone 'a'" in result.stderr


def test_check_reports_the_error_with_file_and_line(tmp_path: Path, tokenizer_file: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('name = "p"\n\n[[zones]]\nlabel = "a"\nuntil = "<|assistant_end|>"\ngoto = "b"\n')
    result = invoke("check", str(path), "--tokenizer", str(tokenizer_file))
    assert result.exit_code == 1
    assert f"error: {path}:6: zone 'a': goto needs jump_on" in result.stderr
    assert "fix:" in result.stderr and "Traceback" not in result.output


def test_missing_tokenizer_is_a_clean_error(tmp_path: Path) -> None:
    result = invoke("check", "chat", "--tokenizer", str(tmp_path / "nothing"))
    assert result.exit_code == 1 and "cannot read tokenizer" in result.stderr
