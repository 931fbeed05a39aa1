"""Compiling a `ProgramSource` against a tokenizer into a token-level `Program`.

Every check a user can fail is here, reported as a `ProgramError` with the file, line and zone. Decisions the
semantics leave to the compiler:

* Budget. A zone's budget counts every token it emits, its feed and its exit token included. A generating zone's
  budget (its own or the program's `max_genned_per_zone`) must be larger than its feed, or the model would never
  get a token; budget 0 makes a forced-only zone, which needs forced text and no triggers.
* Timeout token. On timeout the zone emits `timeout_token` if declared, else the first token of `until` written
  as a token or list; for a `{contains = "x"}` set, the token whose text is exactly "x" (an error asks for an
  explicit `timeout_token` when there is none).
* Overlapping sets. A token both in `until` and in `jump_on` takes the jump (so `until = {contains = '"'}` and
  `jump_on = {contains = '",'}` split the closing quotes of a JSON value by what follows them).
* Canonical feed. Forced text is tokenized as it appears after the preceding forced text when nothing comes
  between them (after forced-only zones), so BPE merges are the ones the model saw in training. Text that would
  merge with that preceding text, or that ends where common continuations would merge with it (typically a
  trailing space, which byte-level BPE attaches to the next word), is warned about: the model would be made to
  continue from a tokenization it never saw.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from tokenizers import Tokenizer

from chatapp.errors import ProgramError
from chatapp.ttfa.program import Program, Zone
from chatapp.ttfa.source import MAX_BUDGET, Contains, ProgramSource, TokenSpec, ZoneSource
from chatapp.ttfa.vocab import TokenVocab

DEFAULT_PAD = "<|assistant_end|>"
HALT = "halt"


@dataclass(frozen=True)
class ProgramBudget:
    """Limits of one program compile. A program file may hold thousands of zones (up to `MAX_PROGRAM_BYTES`), and
    forced text after forced-only zones is tokenized together with all the text before it, so a hostile file could
    cost minutes: the compile stops after `seconds` of its thread's CPU time, or as soon as `cancel` is set (the
    TUI's esc, or quitting while a program compiles)."""

    seconds: float = 10.0
    cancel: threading.Event | None = None


DEFAULT_PROGRAM_BUDGET = ProgramBudget()


class ProgramCancelled(ProgramError):
    """The compile was cancelled by its caller (not the program's fault)."""


class _Compiler:
    def __init__(
        self,
        source: ProgramSource,
        tokenizer: Tokenizer,
        aliases: Mapping[str, str] | None = None,
        budget: ProgramBudget = DEFAULT_PROGRAM_BUDGET,
    ) -> None:
        self.source = source
        self.vocab = TokenVocab(tokenizer, aliases)
        self.warnings: list[str] = []
        self.budget = budget
        self.deadline = time.thread_time() + budget.seconds

    def check_budget(self) -> None:
        """Stop the compile if it was cancelled or has used up its time (called between zones and tokenizations)."""
        name = self.source.file or self.source.name
        if self.budget.cancel is not None and self.budget.cancel.is_set():
            raise ProgramCancelled(f"compiling program {name} was cancelled", hint="load the program again")
        if time.thread_time() > self.deadline:
            raise self.error(
                f"the program took more than {self.budget.seconds:g} s of CPU time to compile (the limit)",
                hint="use fewer zones and shorter forced text (forced text after forced-only zones is tokenized "
                "together with all the text before it)",
            )

    def error(self, message: str, zone: ZoneSource | None = None, key: str | None = None, hint: str | None = None):
        if zone is None:
            line = self.source.key_lines.get(key) if key else None
            return ProgramError(message, hint=hint, file=self.source.file, line=line)
        line = zone.line_of(key) if key else zone.line
        return ProgramError(message, hint=hint, file=self.source.file, line=line, zone=zone.label)

    def warn(self, message: str, zone: ZoneSource) -> None:
        place = ":".join(str(p) for p in (self.source.file, zone.line_of("force")) if p is not None)
        self.warnings.append(f"{place + ': ' if place else ''}zone {zone.label!r}: {message}")

    # -- program level -----------------------------------------------------------------------------------------

    def compile(self) -> Program:
        source = self.source
        if not source.zones:
            raise self.error("the program declares no zones", key="zones", hint="add at least one [[zones]] table")
        if duplicates := sorted({t for t in source.tags if source.tags.count(t) > 1}):
            raise self.error(f"tag {duplicates[0]!r} is declared twice", key="tags", hint="declare each tag once")
        if source.max_genned_per_zone is not None and source.max_genned_per_zone > MAX_BUDGET:
            raise self.error(
                "max_genned_per_zone must be no larger than 2**30", key="max_genned_per_zone",
                hint="leave it out for no limit",
            )
        if source.max_genned_per_zone is not None and source.max_genned_per_zone < 1:
            raise self.error(
                "max_genned_per_zone must be at least 1", key="max_genned_per_zone", hint="leave it out for no limit"
            )
        pad = self.pad()
        labels = self.labels()
        zones = []
        context = ""
        for source_zone in source.zones:
            self.check_budget()
            zone = self.zone(source_zone, labels, context)
            zones.append(zone)
            # Forced text continues the previous zone's only when no model text comes between: after a
            # forced-only zone.
            context = context + source_zone.force if zone.budget == 0 else ""
        return Program(
            name=source.name,
            zones=tuple(zones),
            tag_names=source.tags,
            pad=pad,
            vocab_size=self.vocab.size,
            max_genned_per_zone=source.max_genned_per_zone,
            source=source.file,
            warnings=tuple(self.warnings),
        )

    def pad(self) -> int:
        name = self.source.pad if self.source.pad is not None else DEFAULT_PAD
        token = self.vocab.token(name)
        if token is None:
            raise self.error(
                f"pad {name!r} is not a single token of this tokenizer",
                key="pad",
                hint="set pad to a token that exists, e.g. the end-of-turn token",
            )
        return token

    def labels(self) -> dict[str, int]:
        labels: dict[str, int] = {}
        for index, zone in enumerate(self.source.zones):
            if zone.label == HALT:
                raise self.error(
                    f"{HALT!r} is reserved for the end of the program", zone, "label", hint="rename the zone"
                )
            if zone.label in labels:
                raise self.error(f"label {zone.label!r} is used by two zones", zone, "label", hint="rename one")
            labels[zone.label] = index
        labels[HALT] = len(self.source.zones)
        return labels

    # -- one zone --------------------------------------------------------------------------------------------

    def zone(self, zone: ZoneSource, labels: dict[str, int], context: str) -> Zone:
        if undeclared := [t for t in zone.tags if t not in self.source.tags]:
            raise self.error(
                f"tag {undeclared[0]!r} is not declared",
                zone,
                "tags",
                hint=f"add it to the program's tags = [...] (declared: {list(self.source.tags)})",
            )
        feed = self.feed(zone, context)
        budget = zone.budget
        if budget is not None and budget < 0:
            raise self.error(
                "budget must be >= 0", zone, "budget", hint="use 0 for a forced-only zone, or leave it out"
            )
        if budget is not None and budget > MAX_BUDGET:
            raise self.error("budget must be no larger than 2**30", zone, "budget", hint="leave it out for no limit")
        if budget == 0:
            return self.forced_only_zone(zone, feed)
        effective = budget if budget is not None else self.source.max_genned_per_zone
        if effective is not None and effective <= len(feed):
            raise self.error(
                f"budget {effective} leaves no token for the model after {len(feed)} forced tokens",
                zone,
                "budget" if budget is not None else "force",
                hint=f"raise the budget above {len(feed)} (it counts the feed and the exit token), or use 0 for a "
                "forced-only zone",
            )
        if zone.until is None and zone.jump_on is None:
            raise self.error(
                "the zone never ends: the model has no token to leave it",
                zone,
                hint="add until = <token>, or budget = 0 for a zone that only forces text",
            )
        until = self.token_set(zone, "until", zone.until)
        jump_on, jump_to = self.jump(zone, labels)
        timeout = self.timeout_token(zone, effective)
        return Zone(
            label=zone.label,
            feed=tuple(feed),
            until=frozenset(until),
            jump_on=frozenset(jump_on),
            jump_to=jump_to,
            timeout_token=timeout,
            tags=zone.tags,
            budget=budget,
            line=zone.line,
        )

    def forced_only_zone(self, zone: ZoneSource, feed: list[int]) -> Zone:
        if not feed:
            raise self.error(
                "a forced-only zone (budget 0) needs forced text", zone, "budget", hint='add force = "..."'
            )
        for key in ("until", "jump_on", "timeout_token"):
            if getattr(zone, key) is not None:
                raise self.error(
                    f"{key} has no effect in a forced-only zone (budget 0): the model never writes in it",
                    zone,
                    key,
                    hint="remove it, or give the zone a budget larger than its forced text",
                )
        if zone.goto is not None:
            raise self.error("goto has no effect in a forced-only zone (budget 0)", zone, "goto", hint="remove it")
        return Zone(label=zone.label, feed=tuple(feed), tags=zone.tags, budget=0, line=zone.line)

    def jump(self, zone: ZoneSource, labels: dict[str, int]) -> tuple[list[int], int | None]:
        if zone.jump_on is None and zone.goto is None:
            return [], None
        if zone.goto is None:
            raise self.error(
                "jump_on needs goto", zone, "jump_on", hint='add goto = "<label>" (or "halt"): where the jump goes'
            )
        if zone.jump_on is None:
            raise self.error("goto needs jump_on", zone, "goto", hint="add jump_on = <token>: what triggers the jump")
        if zone.goto not in labels:
            known = [label for label in labels if label != HALT]
            raise self.error(f"goto {zone.goto!r} names no zone", zone, "goto", hint=f"use one of {known} or {HALT!r}")
        return self.token_set(zone, "jump_on", zone.jump_on), labels[zone.goto]

    def token_set(self, zone: ZoneSource, key: str, spec: TokenSpec | None) -> list[int]:
        if spec is None:
            return []
        if isinstance(spec, Contains):
            tokens = self.vocab.containing(spec.text)
            if not tokens:
                message = f"no token contains {spec.text!r}"
                if key == "until":
                    raise self.error(message, zone, key, hint="trigger on a token that exists")
                self.warn(f"{key}: {message}; the jump can never be taken", zone)
            return tokens
        names = (spec,) if isinstance(spec, str) else spec
        return [self.single_token(zone, key, name) for name in names]

    def single_token(self, zone: ZoneSource, key: str, name: str) -> int:
        token = self.vocab.token(name)
        if token is None:
            pieces = [self.vocab.texts[t] for t in self.vocab.encode(name)]
            raise self.error(
                f"{key} {name!r} is not a single token (it tokenizes as {pieces})",
                zone,
                key,
                hint=f'trigger on one of those tokens, a list of tokens, or {{contains = "{name}"}}',
            )
        return token

    def timeout_token(self, zone: ZoneSource, budget: int | None) -> int | None:
        if zone.timeout_token is not None:
            return self.single_token(zone, "timeout_token", zone.timeout_token)
        spec = zone.until
        if isinstance(spec, str):
            return self.single_token(zone, "until", spec)
        if isinstance(spec, tuple):
            return self.single_token(zone, "until", spec[0])
        if isinstance(spec, Contains):
            if (token := self.vocab.token(spec.text)) is not None:
                return token
            raise self.error(
                f"no token is exactly {spec.text!r}, so a timeout has nothing canonical to emit",
                zone,
                "until",
                hint="add timeout_token = <token> (the token forced when the budget runs out)",
            )
        if budget is not None:  # only jump_on exits, but the zone can still time out
            raise self.error(
                "the zone can time out but has no until token to emit", zone, hint="add timeout_token = <token>"
            )
        return None

    # -- canonical feeds ---------------------------------------------------------------------------------------

    def feed(self, zone: ZoneSource, context: str) -> list[int]:
        """`zone.force` tokenized as it appears after `context`, with warnings where that is not canonical."""
        text = zone.force
        if not text:
            return []
        tokens = self.vocab.encode(text)
        if context:
            self.check_budget()
            context_tokens = self.vocab.encode(context)
            self.check_budget()
            together = self.vocab.encode(context + text)
            if together[: len(context_tokens)] == context_tokens:
                tokens = together[len(context_tokens) :]
            else:
                self.warn(
                    f"forced text {text!r} merges with the {context!r} before it; the model will see "
                    f"{[self.vocab.texts[t] for t in tokens]} where training text has "
                    f"{[self.vocab.texts[t] for t in together]}",
                    zone,
                )
        if broken := self.unstable_ending(text):
            self.warn(
                f"forced text {text!r} ends where the tokenizer merges with what usually follows "
                f"({', '.join(repr(c) for c in broken)}); the model must continue from a non-canonical split",
                zone,
            )
        return tokens

    def unstable_ending(self, text: str) -> list[str]:
        """Common continuations after which `text`'s own tokens are no longer a prefix of the tokenization.

        Letters and digits are only tried after a non-alphanumeric ending: after a word they would form a
        different word, which is the model's choice, not a tokenization hazard.
        """
        tokens = self.vocab.encode(text)
        if tokens[-1] in self.vocab.special_ids:  # nothing merges with a special token
            return []
        continuations = [" the", "\n"] + ([] if text[-1].isalnum() else ["the", "1"])
        return [c for c in continuations if self.vocab.encode(text + c)[: len(tokens)] != tokens]


def compile_program(
    source: ProgramSource,
    tokenizer: Tokenizer,
    aliases: Mapping[str, str] | None = None,
    budget: ProgramBudget | None = None,
) -> Program:
    """Compile `source` for `tokenizer` (token names through `aliases`, see `TokenVocab`) within `budget` (the
    default when None); raises `ProgramError` naming the file, line and zone at fault."""
    return _Compiler(source, tokenizer, aliases, budget or DEFAULT_PROGRAM_BUDGET).compile()
