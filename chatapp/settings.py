"""Generation settings and where chatapp keeps its config, data and history.

Locations follow XDG: `$CHATAPP_HOME` overrides everything (tests use it); otherwise config lives in
`$XDG_CONFIG_HOME/chatapp` (default `~/.config/chatapp`) and data (the SQLite history, exports, runs) in
`$XDG_DATA_HOME/chatapp` (default `~/.local/share/chatapp`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

from chatapp.errors import SettingsError

ContextPolicy = Literal["error", "drop_oldest"]


@dataclass(frozen=True)
class GenerationSettings:
    """Per-request sampling settings. `temperature == 0` means greedy; `top_k == 0` and `top_p == 1` disable them."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int = 0
    # Causal-router decision threshold for STT layers at generation time; None uses the model config's
    # `router_threshold` (the student's own threshold, distinct from the teacher's `g_threshold`).
    routing_threshold: float | None = None
    # Routing mode at generation time: "student" (causal router), "off" (every token through every layer).
    routing: Literal["student", "off"] = "student"
    context_policy: ContextPolicy = "error"
    # Push known runs of forced tokens through the model in one forward. Token-identical to step-by-step.
    fast_forward: bool = True
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SettingsError(f"temperature must be >= 0, got {self.temperature}", hint="use 0 for greedy decoding")
        if self.top_k < 0:
            raise SettingsError(f"top_k must be >= 0, got {self.top_k}", hint="use 0 to disable top-k")
        if not 0 < self.top_p <= 1:
            raise SettingsError(f"top_p must be in (0, 1], got {self.top_p}", hint="use 1.0 to disable top-p")
        if self.max_tokens < 1:
            raise SettingsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.routing_threshold is not None and not 0 <= self.routing_threshold <= 1:
            raise SettingsError(f"routing_threshold must be in [0, 1], got {self.routing_threshold}")
        if self.context_policy not in ("error", "drop_oldest"):
            raise SettingsError(
                f"context_policy must be 'error' or 'drop_oldest', got {self.context_policy!r}",
            )

    def with_(self, **changes: object) -> GenerationSettings:
        """A copy with some fields changed (validated again)."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(sorted(unknown))}", hint=f"known: {', '.join(sorted(known))}")
        return replace(self, **changes)


def _home_override() -> Path | None:
    home = os.environ.get("CHATAPP_HOME")
    return Path(home).expanduser() if home else None


def config_dir() -> Path:
    """Directory for user configuration (settings.toml, user TTFA programs)."""
    if (home := _home_override()) is not None:
        return home / "config"
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "chatapp"


def data_dir() -> Path:
    """Directory for data: the chat history database, exports."""
    if (home := _home_override()) is not None:
        return home / "data"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "chatapp"


def engine_log_path() -> Path:
    """Where the TUI's engine process writes its output (loading messages, warnings, a crash's traceback)."""
    return data_dir() / "engine.log"


def history_db_path() -> Path:
    """The SQLite history database."""
    return data_dir() / "history.sqlite3"
