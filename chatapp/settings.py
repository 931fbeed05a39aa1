"""Generation settings and where chatapp keeps its config, data and history.

Locations follow XDG: `$CHATAPP_HOME` overrides everything (tests use it); otherwise config lives in
`$XDG_CONFIG_HOME/chatapp` (default `~/.config/chatapp`) and data (the SQLite history, exports, runs) in
`$XDG_DATA_HOME/chatapp` (default `~/.local/share/chatapp`).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal

from chatapp.errors import SettingsError
from chatapp.validation import check_logprobs

ContextPolicy = Literal["error", "drop_oldest"]

# Upper bounds of the integer settings. Every entry point (quick `generate`, batch lines, the TUI's settings) builds
# a `GenerationSettings`, so these checks are the one validation they share. The bounds keep every value inside
# what torch takes (int64 top-k, unsigned 64-bit generator seeds) and far above any real use.
MAX_TOP_K = 2**31 - 1
MAX_MAX_TOKENS = 1 << 20
MAX_SEED = 2**63 - 1
# llama.cpp's sequence breakers for DRY: a repeat is not extended across a line break, a colon, a quote or an
# asterisk, so a list's structure or a speaker's name is not penalised as a repeat.
DEFAULT_DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")


@dataclass(frozen=True)
class GenerationSettings:
    """Per-request sampling settings. `temperature == 0` means greedy; every other sampler's default turns it off
    (`top_k == 0`, `top_p == 1`, `min_p == 0`, `repetition_penalty == 1`, zero presence, frequency and DRY
    penalties). The penalties apply to greedy rows too. docs/usage.md gives each one's semantics."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    # Drop tokens less likely than min_p times the most likely one (transformers' MinPLogitsWarper).
    min_p: float = 0.0
    # Divide a positive logit / multiply a negative one of every token seen in the last `repeat_last_n` tokens
    # (transformers' RepetitionPenaltyLogitsProcessor, llama.cpp's repeat_penalty).
    repetition_penalty: float = 1.0
    # OpenAI's: logit -= presence_penalty * (count > 0) + frequency_penalty * count, counted over the same window.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # The window of the three penalties above, in tokens the penalties see (llama.cpp's: -1 = all, 0 = none).
    repeat_last_n: int = 64
    # DRY ("don't repeat yourself", llama.cpp's): a token that would extend a repeat of length >= allowed_length
    # loses multiplier * base ** (length - allowed_length); 0 = off. Repeats do not extend across a token whose
    # text holds a sequence breaker.
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_SEQUENCE_BREAKERS
    max_tokens: int = 256
    seed: int = 0
    # Causal-router decision threshold for STT layers at generation time; None uses the model config's
    # `router_threshold` (the student's own threshold, distinct from the teacher's `g_threshold`).
    routing_threshold: float | None = None
    # Routing mode at generation time: "student" (causal router), "off" (every token through every layer).
    routing: Literal["student", "off"] = "student"
    # A named operating point of the model (`--routing LEVEL`: "off" or one of the model's `routing_levels`, e.g.
    # "quality", "fast"); when set it decides `routing` and `routing_threshold` (the engine resolves it).
    routing_level: str | None = None
    context_policy: ContextPolicy = "error"
    # Push known runs of forced tokens through the model in one forward. Token-identical to step-by-step.
    fast_forward: bool = True
    stop_tokens: tuple[int, ...] = field(default_factory=tuple)
    # Per emitted token, report its log-probability, the entropy and this many most likely alternatives
    # (`TokenEvent.logprobs`); 0 = off, and off costs nothing.
    logprobs: int = 0

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, hint="use 0 for greedy decoding")
        _check_int("top_k", self.top_k, 0, MAX_TOP_K, hint="use 0 to disable top-k")
        _check_number("top_p", self.top_p, hint="use 1.0 to disable top-p")
        _check_int(
            "max_tokens", self.max_tokens, 1, MAX_MAX_TOKENS, hint=f"use a count between 1 and {MAX_MAX_TOKENS:,}"
        )
        _check_int("seed", self.seed, 0, MAX_SEED, hint="use a seed between 0 and 2**63-1")
        check_logprobs(self.logprobs)
        if self.temperature < 0:
            raise SettingsError(f"temperature must be >= 0, got {self.temperature}", hint="use 0 for greedy decoding")
        if not 0 < self.top_p <= 1:
            raise SettingsError(f"top_p must be in (0, 1], got {self.top_p}", hint="use 1.0 to disable top-p")
        self._check_penalties()
        if self.routing_threshold is not None:
            _check_number("routing_threshold", self.routing_threshold, hint="use a threshold between 0 and 1")
            if not 0 <= self.routing_threshold <= 1:
                raise SettingsError(
                    f"routing_threshold must be in [0, 1], got {self.routing_threshold}",
                    hint="use a threshold between 0 and 1, or leave it unset for the model's own",
                )
        if self.routing_level is not None and (not isinstance(self.routing_level, str) or not self.routing_level):
            raise SettingsError(
                f"routing_level must be a level's name, got {self.routing_level!r}",
                hint="use off, or a level the model names (chatapp models lists them)",
            )
        if self.context_policy not in ("error", "drop_oldest"):
            raise SettingsError(
                f"context_policy must be 'error' or 'drop_oldest', got {self.context_policy!r}",
                hint="use 'error' or 'drop_oldest'",
            )

    def _check_penalties(self) -> None:
        if isinstance(self.dry_sequence_breakers, list):  # as JSON and generation_config.json write it
            object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        _check_number("min_p", self.min_p, hint="use 0 to disable min-p")
        if not 0 <= self.min_p <= 1:
            raise SettingsError(f"min_p must be in [0, 1], got {self.min_p}", hint="use 0 to disable min-p")
        _check_number("repetition_penalty", self.repetition_penalty, hint="use 1.0 to disable it")
        if self.repetition_penalty <= 0:
            raise SettingsError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                hint="use 1.0 to disable it; values above 1 discourage repeats (1.1 is common)",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value, hint="use 0 to disable it")
            if not -2 <= value <= 2:
                raise SettingsError(f"{name} must be between -2 and 2 (OpenAI's range), got {value}", hint="use 0 to disable it")
        window_hint = "use -1 for every token the penalties see, 0 to see none, or a count of recent tokens"
        _check_int("repeat_last_n", self.repeat_last_n, -1, MAX_MAX_TOKENS, hint=window_hint)
        _check_int("dry_penalty_last_n", self.dry_penalty_last_n, -1, MAX_MAX_TOKENS, hint=window_hint)
        _check_number("dry_multiplier", self.dry_multiplier, hint="use 0 to disable DRY (0.8 is common)")
        if self.dry_multiplier < 0:
            raise SettingsError(f"dry_multiplier must be >= 0, got {self.dry_multiplier}", hint="use 0 to disable DRY")
        _check_number("dry_base", self.dry_base, hint="use 1.75 (llama.cpp's default)")
        if not 1 <= self.dry_base <= 16:
            raise SettingsError(f"dry_base must be between 1 and 16, got {self.dry_base}", hint="use 1.75 (llama.cpp's default)")
        _check_int("dry_allowed_length", self.dry_allowed_length, 1, MAX_MAX_TOKENS, hint="use 2 (llama.cpp's default)")
        breakers = self.dry_sequence_breakers
        if not isinstance(breakers, tuple) or not all(isinstance(b, str) and b for b in breakers):
            raise SettingsError(
                f"dry_sequence_breakers must be a list of non-empty strings, got {breakers!r}",
                hint='use e.g. ["\\n", ":", "\\"", "*"] (llama.cpp\'s default), or [] for none',
            )

    @property
    def penalized(self) -> bool:
        """Whether any penalty (repetition, presence, frequency, DRY) is on: only then does a row keep the tokens
        it emitted on the device."""
        counted = self.repeat_last_n != 0 and (
            self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
        )
        return counted or (self.dry_multiplier > 0 and self.dry_penalty_last_n != 0)

    def with_(self, **changes: object) -> GenerationSettings:
        """A copy with some fields changed (validated again)."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise SettingsError(f"unknown setting(s): {', '.join(sorted(unknown))}", hint=f"known: {', '.join(sorted(known))}")
        return replace(self, **changes)


SAMPLING_FIELDS: tuple[str, ...] = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "repeat_last_n",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
)
"""The settings a model's `generation_config.json` may give defaults for (`models.generation_config`)."""

SettingSource = Literal["option", "model", "built-in"]
SOURCE_LABELS: dict[SettingSource, str] = {
    "option": "option",
    "model": "the model's generation_config.json",
    "built-in": "built-in",
}


def with_model_defaults(
    settings: GenerationSettings, model_defaults: Mapping[str, object], chosen: Collection[str] = ()
) -> GenerationSettings:
    """`settings` with the model's own default in every sampling field it gives, except the fields in `chosen`
    (those the user set: an option, a batch line's field, the TUI's settings)."""
    return settings.with_(**{name: value for name, value in model_defaults.items() if name not in chosen})


def setting_sources(model_defaults: Mapping[str, object], chosen: Collection[str] = ()) -> dict[str, SettingSource]:
    """Where each sampling field's value comes from: an option the user set, the model's defaults, or built in."""
    return {
        name: "option" if name in chosen else "model" if name in model_defaults else "built-in"
        for name in SAMPLING_FIELDS
    }


def _check_int(name: str, value: object, low: int, high: int, hint: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(f"{name} must be an integer, got {value!r}", hint=hint)
    if not low <= value <= high:
        shown = str(value) if len(str(value)) <= 30 else f"a {len(str(value))}-digit number"
        raise SettingsError(f"{name} must be between {low} and {high}, got {shown}", hint=hint)


def _check_number(name: str, value: object, hint: str | None = None) -> None:
    """A finite real number: NaN passes every `<` comparison test as False, so it is named here, not by a range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SettingsError(f"{name} must be a number, got {value!r}", hint=hint)
    if not math.isfinite(value):
        raise SettingsError(f"{name} must be a finite number, got {value}", hint=hint)


KERNEL_THREADS_ENV = "CHATAPP_KERNEL_THREADS"
"""Threads of the int8 decode kernel's OpenMP pool (`stt.cpu_step`); unset: torch's count when a step starts."""


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: a container or `taskset` may give it fewer than
    the machine has)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def threads_from_env(name: str) -> int | None:
    """The thread count set in `$name`: None when unset or empty; a `SettingsError` naming it and the fix when it
    is not a positive integer. At most `usable_cores()`: a thread more than there are cores only waits for the others
    (with 10000 kernel threads a reply took 174 s instead of 14 s), so more means all of them."""
    wanted = os.environ.get(name, "").strip()
    if not wanted:
        return None
    hint = f"set {name} to a number of threads from 1 to {usable_cores()} (the cores this process may use), or unset it"
    shown = wanted if len(wanted) <= 30 else f"{wanted[:27]}..."
    try:
        threads = int(wanted)
    except ValueError:
        raise SettingsError(f"{name}={shown!r} is not a whole number", hint=hint) from None
    if threads < 1:
        raise SettingsError(f"{name}={shown!r} must be at least 1", hint=hint)
    return min(threads, usable_cores())


# What libgomp accepts for `$GOMP_SPINCOUNT` (its `parse_spincount`): a count, optionally followed by k, M, G or T,
# or INFINITE / INFINITY. Anything else it answers with a warning of its own and its default spin: neither names the
# fix. (chatapp's own default is set in `lifecycle.starting_up`.)
_SPIN_VALUE = re.compile(r"\s*(?:infinite|infinity|\+?(?P<count>[0-9]+)\s*[kmgt]?)\s*", re.IGNORECASE)


def check_spin_count() -> None:
    """Refuse (`SettingsError`, naming the variable and the fix) a `$GOMP_SPINCOUNT` that libgomp would not take,
    before torch (and libgomp with it) is loaded."""
    from chatapp.lifecycle import SPIN_COUNT, SPIN_ENV

    value = os.environ.get(SPIN_ENV)
    if value is None:
        return
    match = _SPIN_VALUE.fullmatch(value)
    if match is None or (match["count"] is not None and int(match["count"]) >= 1 << 64):
        shown = value if len(value) <= 30 else f"{value[:27]}..."
        raise SettingsError(
            f"{SPIN_ENV}={shown!r} is not a spin count (OpenMP's wait at a join)",
            hint=f"unset {SPIN_ENV} (chatapp then sets {SPIN_COUNT}), or set a whole number such as "
            f"{SPIN_ENV}={SPIN_COUNT} (a k, M, G or T suffix, or INFINITE, as libgomp reads it)",
        )


def _home_override() -> Path | None:
    home = os.environ.get("CHATAPP_HOME")
    return Path(home).expanduser() if home else None


def config_dir() -> Path:
    """Directory for user configuration (shown by `chatapp info` and the TUI's help; nothing is read from it yet)."""
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


ROUTED_SUBDIR = "routed"
LOCKS_SUBDIR = "locks"


def routed_models_dir() -> Path:
    """Where `chatapp route` puts the routed copy of a model when no --out is given (a built-in model is never
    rewritten in place); `chatapp models` lists what is there, and `--model NAME` names it."""
    return data_dir() / ROUTED_SUBDIR


def data_dir_hint() -> str:
    """How to point chatapp at another data directory."""
    if _home_override() is not None:
        return "set CHATAPP_HOME to a writable directory (or unset it)"
    return "set XDG_DATA_HOME or CHATAPP_HOME to a writable directory, or fix the permissions of this one"


def check_data_dir() -> Path:
    """The data directory, created if missing; `DataDirError` naming it and the fix when it is a file, cannot be
    created or cannot be written. Checked before work that writes there (preparing the default model)."""
    from chatapp.errors import DataDirError
    from chatapp.store import check_writable_dir

    path = data_dir()
    try:
        return check_writable_dir(path, "data directory")
    except DataDirError as err:
        raise DataDirError(err.message, hint=data_dir_hint()) from None


def data_dir_problem() -> str | None:
    """Why the data directory cannot be used, or None (for reports that must not fail and create nothing:
    `chatapp info`, `chatapp models`)."""
    from chatapp.store import writable_dir_problem

    return writable_dir_problem(data_dir(), "data directory")


def locks_dir() -> Path:
    """Where the lock files of the outputs a user names (`chatapp convert`, `chatapp route --out`) live, so that
    none is left beside the output (`chatapp.store.lock_path`); checked and created before such a command works."""
    from chatapp.errors import DataDirError
    from chatapp.store import check_writable_dir

    path = data_dir() / LOCKS_SUBDIR
    try:
        return check_writable_dir(path, "lock directory")
    except DataDirError as err:
        raise DataDirError(err.message, hint=data_dir_hint()) from None


def clean_data_dir() -> None:
    """Remove the staging and the lock files that killed processes left in the data directory
    (`chatapp.store.clean_stale`, `chatapp.store.clean_locks`); run at every start, cheap (a few directory
    listings), never fails."""
    from chatapp.store import clean_locks, clean_stale

    for sub in ("models", "compiled", "served", ROUTED_SUBDIR):
        clean_stale(data_dir() / sub, legacy=True)
    clean_locks(data_dir() / LOCKS_SUBDIR)  # those of writers killed before they finished


def engine_log_path() -> Path:
    """Where the TUI's engine process writes its output (loading messages, warnings, a crash's traceback)."""
    return data_dir() / "engine.log"


def history_db_path() -> Path:
    """The SQLite history database."""
    return data_dir() / "history.sqlite3"
