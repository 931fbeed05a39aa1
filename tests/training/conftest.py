"""A tiny Qwen2 GGUF converted as a user would (`chatapp convert`), for the routing fit and its fine-tune."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatapp.cli import app
from tests.models.gguf_files import write_tiny_gguf


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("converted")
    tiny = write_tiny_gguf(folder / "tiny.gguf", "qwen2", seed=3)
    result = CliRunner().invoke(app, ["convert", str(tiny.path), str(folder / "model")])
    assert result.exit_code == 0, result.output
    return folder / "model"
