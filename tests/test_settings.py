from __future__ import annotations

from pathlib import Path

import pytest

from chatapp.errors import SettingsError
from chatapp.settings import GenerationSettings, config_dir, data_dir, history_db_path


def test_defaults_are_greedy_and_valid() -> None:
    s = GenerationSettings()
    assert s.temperature == 0.0 and s.top_k == 0 and s.top_p == 1.0


@pytest.mark.parametrize(
    "changes",
    [{"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_tokens": 0},
     {"routing_threshold": 2.0}, {"context_policy": "truncate"}, {"min_p": 1.5}, {"min_p": float("nan")},
     {"repetition_penalty": 0.0}, {"presence_penalty": 2.5}, {"frequency_penalty": -3.0}, {"repeat_last_n": -2},
     {"dry_multiplier": -1.0}, {"dry_base": 0.5}, {"dry_allowed_length": 0}, {"dry_penalty_last_n": -5},
     {"dry_sequence_breakers": ("",)}, {"dry_sequence_breakers": "\n"}],
)
def test_invalid_values_raise_a_clear_error(changes: dict) -> None:
    with pytest.raises(SettingsError) as info:
        GenerationSettings().with_(**changes)
    assert next(iter(changes)) in str(info.value)


def test_unknown_setting_is_named() -> None:
    with pytest.raises(SettingsError, match="temprature"):
        GenerationSettings().with_(temprature=1.0)


def test_paths_follow_chatapp_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CHATAPP_HOME", str(tmp_path))
    assert config_dir() == tmp_path / "config"
    assert data_dir() == tmp_path / "data"
    assert history_db_path().parent == tmp_path / "data"


def test_paths_follow_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHATAPP_HOME", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "d"))
    assert config_dir() == tmp_path / "c" / "chatapp"
    assert data_dir() == tmp_path / "d" / "chatapp"


def test_a_penalty_is_on_only_when_it_changes_something() -> None:
    assert not GenerationSettings().penalized
    assert not GenerationSettings(repetition_penalty=1.3, repeat_last_n=0).penalized
    assert not GenerationSettings(dry_multiplier=0.8, dry_penalty_last_n=0).penalized
    assert GenerationSettings(frequency_penalty=0.1).penalized and GenerationSettings(dry_multiplier=0.8).penalized
    assert GenerationSettings(dry_sequence_breakers=["\n"]).dry_sequence_breakers == ("\n",)  # JSON's lists
