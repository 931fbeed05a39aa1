"""The model registry: `--model` values are registered names or paths; the default is decided in one place."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatapp.errors import ModelDirError
from chatapp.models import default_model_dir, resolve_model
from chatapp.models.registry import tiny_model_dir


def test_a_name_a_path_and_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model("tiny") == tiny_model_dir()
    assert resolve_model(None) == default_model_dir()
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(tmp_path) == tmp_path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    assert resolve_model("tiny") == tiny_model_dir()  # a name wins over a directory of that name
    assert resolve_model("./tiny") == Path("./tiny")


def test_an_unknown_name_or_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="does not exist") as info:
        resolve_model(str(tmp_path / "nowhere"))
    assert "tiny" in (info.value.hint or "")
