"""Limits on what a request may ask for, checked before any work starts, shared by quick and batch mode.

Each check raises a `ChatappError` naming the input and the limit, so a hostile or mistyped input costs a message,
not minutes of tokenizing or compiling, gigabytes of rows, or a traceback. The numeric ranges of the sampling
settings live with `GenerationSettings` (every entry point builds one); this module holds the rest: text that is not
Unicode, prompt size, samples per line, and the size of regex and JSON-schema constraints.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from typing import Any

from chatapp.errors import ChatappError, ConstraintError, SettingsError

FORMATS = ("float32", "bfloat16", "int8", "int4")
"""The weight formats a model can be run in (`chatapp.stt.weights`), by their canonical names."""
_FORMAT_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "q8": "int8", "q4": "int4"}


class WeightFormatError(ChatappError):
    """An unknown weight format was asked for."""


def parse_format(name: str | None) -> str | None:
    """The canonical format name for a user's `--dtype` value; None and "auto" mean "pick per device". Here, not
    beside the formats in `stt.weights`, so that checking an option imports no torch."""
    if name is None or name == "auto":
        return None
    key = name.strip().lower()
    key = _FORMAT_ALIASES.get(key, key)
    if key not in FORMATS:
        raise WeightFormatError(
            f"unknown weight format {name!r}", hint=f"use one of: auto, {', '.join(FORMATS)} (or fp32, bf16)"
        )
    return key


MAX_SAMPLES = 1024
"""Samples one request (a batch line, `--samples`) may ask for: each sample is a row held until it is written."""

MAX_REGEX_CHARS = 10_000
"""Longest regex constraint, in characters."""

MAX_SCHEMA_CHARS = 100_000
"""Longest JSON-schema constraint, as compact JSON text."""

MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of objects and arrays in a JSON-schema constraint."""

MAX_LOGPROBS = 20
"""Most alternatives a request may ask to see per token (`logprobs`): OpenAI's `top_logprobs` bound."""


def find_lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate in `text` (None if it is proper Unicode).

    JSON's `"\\ud800"` escapes and command-line bytes that are not UTF-8 (Python maps them to U+DC80..U+DCFF) both
    end up as surrogates, which no tokenizer, terminal or UTF-8 file can hold.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return err.start
    return None


def check_text(name: str, text: str, *, hint: str | None = None) -> None:
    """`SettingsError` if `text` holds a lone surrogate (it is not valid Unicode, e.g. undecodable bytes)."""
    index = find_lone_surrogate(text)
    if index is not None:
        code = ord(text[index])
        what = f"the byte 0x{code - 0xDC00:02x}, which is not UTF-8" if 0xDC80 <= code <= 0xDCFF else (
            f"a lone surrogate U+{code:04X}, which is not a Unicode character"
        )
        raise SettingsError(
            f"{name} holds {what} (character {index + 1})",
            hint=hint or f"pass {name} as UTF-8 text",
        )


def strings_in(value: Any) -> Iterable[str]:
    """Every string (keys included) inside a parsed JSON value, without recursion (depth cannot overflow)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Sequence[Any] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_logprobs(value: object) -> None:
    """`logprobs` is how many alternatives each token reports, 0 (off) to `MAX_LOGPROBS`: an integer, not a flag, so
    `true` (an `int` to Python) is refused rather than read as 1."""
    hint = f"use 0 for none, or up to {MAX_LOGPROBS} alternatives per token"
    if isinstance(value, bool) or not isinstance(value, int):
        raise SettingsError(f"logprobs must be an integer, got {value!r}", hint=hint)
    if not 0 <= value <= MAX_LOGPROBS:
        shown = str(value) if len(str(value)) <= 30 else f"a {len(str(value))}-digit number"
        raise SettingsError(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {shown}", hint=hint)


def check_regex_source(pattern: str) -> None:
    """Size limit of a regex constraint, before it is parsed."""
    check_text("the regex", pattern)
    if len(pattern) > MAX_REGEX_CHARS:
        raise ConstraintError(
            f"the regex is {len(pattern):,} characters, more than the limit of {MAX_REGEX_CHARS:,}",
            hint="use a shorter regex",
        )


def check_schema_source(schema: Any) -> None:
    """Size and depth limits of a JSON-schema constraint, before it is compiled."""
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ConstraintError(
            f"the JSON schema is nested {depth} levels deep, more than the limit of {MAX_SCHEMA_DEPTH}",
            hint="flatten the schema",
        )
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > MAX_SCHEMA_CHARS:
        raise ConstraintError(
            f"the JSON schema is {size:,} characters of JSON, more than the limit of {MAX_SCHEMA_CHARS:,}",
            hint="use a smaller schema",
        )


@functools.lru_cache(maxsize=4)  # keyed by the tokenizer object: a scan of its vocabulary, ~50 ms for 49k tokens
def longest_token_chars(tokenizer: Any) -> int:
    """Characters in the longest token string of `tokenizer` (at least 1).

    A token's string is at least as long as the text it decodes to (byte-level BPE spells each byte as one character,
    byte fallback as `<0xNN>`), so a prompt of more than context x this many characters cannot fit the context.
    """
    return max(1, max((len(token) for token in tokenizer.get_vocab()), default=1))


MAX_PROMPT_BYTES = 64 << 20
"""Most bytes read as one prompt from a stream (`generate -`): far above what any context here holds (8,192 tokens of
at most a few hundred characters each), and a bound on the memory a stream that never ends can take."""

def blank(text: str) -> str | None:
    """What is wrong with a prompt that says nothing ("empty", "only white space (N characters)"), or None: the one
    rule `generate` and batch lines share."""
    if text.strip():
        return None
    return "empty" if not text else f"only white space ({len(text):,} characters)"


def check_prompt_text(prompt: str) -> None:
    """A prompt a user gave: Unicode text (`check_text`) with something in it besides white space."""
    check_text("the prompt", prompt)
    if (what := blank(prompt)) is not None:
        raise SettingsError(
            f"the prompt is {what}",
            hint='write what the model should answer, e.g. `chatapp generate "Say hi"`, or pipe it into `generate -`',
        )


def check_prompt_chars(chars: int, context_size: int, chars_per_token: int) -> None:
    """Reject a prompt too long for the context before tokenizing it (tokenizing a long run without spaces is
    quadratic: a 1 MB word takes minutes)."""
    limit = context_size * max(1, chars_per_token)
    if chars > limit:
        raise SettingsError(
            f"the prompt is {chars:,} characters; the model's context of {context_size:,} tokens holds at most "
            f"{limit:,} (its longest token is {chars_per_token} characters)",
            hint="shorten the prompt",
        )


def check_prompt_fits(chars: int, context_size: int, tokenizer: Any) -> None:
    """`check_prompt_chars` with `tokenizer`'s longest token, looked up only for a prompt of more characters than
    the context has tokens: a shorter one is within the limit whatever that token is."""
    if chars > context_size:
        check_prompt_chars(chars, context_size, longest_token_chars(tokenizer))


def prompt_chars(prompt: str | None, messages: Sequence[Any] | None) -> int:
    """Characters of user-supplied text in a request (every string inside its messages)."""
    if prompt is not None:
        return len(prompt)
    return sum(len(text) for text in strings_in(list(messages or ())))


