"""A model's own sampling defaults, from its directory's `generation_config.json` (transformers' format).

The keys read are transformers' `temperature`, `top_k`, `top_p`, `min_p`, `repetition_penalty` and `do_sample`,
and chatapp's (llama.cpp's and OpenAI's names) for what transformers has no key for: `presence_penalty`,
`frequency_penalty`, `repeat_last_n`, `dry_multiplier`, `dry_base`, `dry_allowed_length`, `dry_penalty_last_n`,
`dry_sequence_breakers`. A key the file leaves out keeps chatapp's built-in default (transformers would take its
own for some: `top_k` 50, `temperature` 1.0); other keys (`eos_token_id`, `max_new_tokens`, ...) are not sampling
defaults and are left alone. `do_sample: false` means greedy whatever `temperature` says, as in transformers;
`do_sample: true` without a `temperature` samples at 1.0, transformers' default; a `temperature` without
`do_sample` is used as it is (transformers would ignore it and warn).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from chatapp.errors import ChatappError, ModelDirError
from chatapp.settings import SAMPLING_FIELDS, GenerationSettings

GENERATION_CONFIG = "generation_config.json"
_MAX_BYTES = 1 << 20
_WHOLE = frozenset({"top_k", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n"})  # integer settings


def read_sampling_defaults(model_dir: Path) -> dict[str, Any]:
    """The sampling defaults `model_dir/generation_config.json` gives (empty without the file or such keys);
    `ModelDirError` naming the file, the key and the fix when it is not JSON or a value is out of range."""
    path = model_dir / GENERATION_CONFIG
    if not path.is_file():
        return {}
    hint = f"fix or remove the key in {path} (docs/usage.md lists the sampling keys and their ranges)"
    try:
        raw = path.read_bytes()[:_MAX_BYTES]
        config = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ModelDirError(
            f"{path} is not readable JSON ({err})", hint=f"fix {path}, or remove it to use chatapp's built-in defaults"
        ) from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{path} must hold a JSON object, not {type(config).__name__}", hint=f"fix {path}")
    defaults = {name: config[name] for name in SAMPLING_FIELDS if name in config}
    do_sample = config.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ModelDirError(f'{path}: "do_sample" must be true or false, got {do_sample!r}', hint=hint)
    if do_sample is False:
        defaults["temperature"] = 0.0
    elif do_sample is True:
        defaults.setdefault("temperature", 1.0)
    if isinstance(defaults.get("dry_sequence_breakers"), list):
        defaults["dry_sequence_breakers"] = tuple(defaults["dry_sequence_breakers"])
    for name, value in defaults.items():  # each checked alone, so that the message names its key
        if name in _WHOLE and isinstance(value, float) and value.is_integer():
            value = int(value)  # a JSON writer may write 40 as 40.0
        elif name not in _WHOLE and type(value) is int:
            value = float(value)
        defaults[name] = value
        try:
            GenerationSettings().with_(**{name: value})
        except ChatappError as err:
            raise ModelDirError(f"{path}: {err.message}", hint=hint) from None
    return defaults
