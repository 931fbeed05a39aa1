"""Penalties on repeats, per row and batched on the device: repetition, presence and frequency over a window of
recent tokens, and DRY.

What a penalty sees: the tokens of the reply being generated, whether the model sampled them or a program, a
grammar or a tool call's markers forced them, because all of them are the reply's text. It does not see the prompt
(the conversation so far: penalising the user's own words would push the reply off the subject) nor a tool's
output (the reply should quote the calculator's result, not avoid it). A forced token is never sampled, so a
penalty changes only what the model picks around it.

State per row, on the device, built when some row of the batch asks for a penalty (otherwise there is none and
nothing runs): the tokens seen, in order (`history`), their counts over the row's window (`counts`), and for DRY,
per earlier position, the length of the longest repeat that ends there and matches the end of the reply
(`match`). Each is updated from a row's own tokens only, so a row's penalties never depend on its batch.

- Repetition (transformers' `RepetitionPenaltyLogitsProcessor`, llama.cpp's `repeat_penalty`): a seen token's
  positive logit is divided by the penalty, a negative one multiplied.
- Presence and frequency (OpenAI's): `logit -= presence * (count > 0) + frequency * count`.
  The three count over the last `repeat_last_n` tokens seen (-1: all of them), as llama.cpp's `repeat_last_n` does.
- DRY (llama.cpp's, after its author's reference implementation): if the reply ends with tokens that also occur
  earlier, followed there by token `c`, then `c` would extend the repeat; with the repeat's length `n >=
  allowed_length`, `c` loses `multiplier * base ** (n - allowed_length)`. A repeat never extends across a
  sequence-breaker token (one whose text holds a breaker string), a breaker is never penalised, and the search
  looks only at the last `dry_penalty_last_n` tokens seen (-1: all).

The repeats are found incrementally: when a token `x` is appended at position `t`, the repeat ending at an earlier
position `i` becomes `match[i] = match[i - 1] + 1` if `history[i] == x` (and `x` is not a breaker), else 0; one
elementwise pass over the row's history a step, where recomputing them would be quadratic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from chatapp.settings import GenerationSettings

# DRY's penalty grows exponentially with a repeat's length; it is capped at float32's largest value, so a long loop
# makes a token all but impossible without an infinity in the logits (llama.cpp caps its exponent the same way).
_MAX_PENALTY = torch.finfo(torch.float32).max
_MAX_LOG = math.log(_MAX_PENALTY) - 1
_FIRST_CAPACITY = 256  # history slots allocated up front; doubled when a row needs more

BreakerMask = Callable[[tuple[str, ...]], torch.Tensor]
"""The (V,) bool mask of the tokens whose text holds one of the given sequence breakers, on the device."""


@dataclass(frozen=True)
class PenaltyParams:
    """Per-row penalty settings as device tensors (one entry per row)."""

    repetition: torch.Tensor  # (B,) float32; 1 = off
    presence: torch.Tensor  # (B,) float32
    frequency: torch.Tensor  # (B,) float32
    repeat_last_n: torch.Tensor  # (B,) int64; -1 = every token seen, 0 = none
    dry_multiplier: torch.Tensor  # (B,) float32; 0 = off
    dry_log_base: torch.Tensor  # (B,) float32
    dry_allowed: torch.Tensor  # (B,) int64
    dry_last_n: torch.Tensor  # (B,) int64; -1 = every token seen, 0 = none
    breakers: torch.Tensor | None  # (B, V) bool, with DRY on in some row

    def select(self, index: torch.Tensor) -> PenaltyParams:
        picked = {
            name: getattr(self, name).index_select(0, index)
            for name in self.__dataclass_fields__
            if getattr(self, name) is not None
        }
        return replace(self, **picked)


@dataclass
class PenaltyState:
    """The tokens each row has emitted so far, as far as its penalties need them, and the penalties they cause."""

    params: PenaltyParams
    counted: bool  # some row has a repetition, presence or frequency penalty
    dry: bool  # some row has DRY on
    history: torch.Tensor  # (B, H) int64: the tokens seen, in order
    length: torch.Tensor  # (B,) int64: how many of `history` are filled
    counts: torch.Tensor | None  # (B, V) float32: each token's count in the row's window
    match: torch.Tensor | None  # (B, H) int32: the repeat ending at each position (module doc)
    scratch: torch.Tensor | None  # (B, V) float32 zeros, for DRY's largest penalty per token (`_apply_dry`)
    window: int  # the widest window of the counted penalties, -1 when some row counts every token it saw
    bound: int = 0  # host-side upper bound on `length` (no device read to grow `history`)

    @classmethod
    def build(
        cls, settings: Sequence[GenerationSettings], vocab: int, device: torch.device, breaker_mask: BreakerMask
    ) -> PenaltyState | None:
        """The penalty state of rows with these settings, or None when no row has a penalty on (then none costs
        anything)."""
        if not any(s.penalized for s in settings):
            return None
        counted = any(s.penalized and s.repeat_last_n != 0 for s in settings)
        dry = any(s.dry_multiplier > 0 and s.dry_penalty_last_n != 0 for s in settings)

        def column(values: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        breakers = None
        if dry:
            masks = {s.dry_sequence_breakers: breaker_mask(s.dry_sequence_breakers) for s in settings}
            breakers = torch.stack([masks[s.dry_sequence_breakers][:vocab] for s in settings])
        params = PenaltyParams(
            repetition=column([s.repetition_penalty for s in settings], torch.float32),
            presence=column([s.presence_penalty for s in settings], torch.float32),
            frequency=column([s.frequency_penalty for s in settings], torch.float32),
            repeat_last_n=column([s.repeat_last_n for s in settings], torch.long),
            dry_multiplier=column([s.dry_multiplier for s in settings], torch.float32),
            dry_log_base=column([math.log(s.dry_base) for s in settings], torch.float32),
            dry_allowed=column([s.dry_allowed_length for s in settings], torch.long),
            dry_last_n=column([s.dry_penalty_last_n if s.dry_multiplier > 0 else 0 for s in settings], torch.long),
            breakers=breakers,
        )
        rows = len(settings)
        return cls(
            params=params,
            counted=counted,
            dry=dry,
            history=torch.zeros(rows, _FIRST_CAPACITY, dtype=torch.long, device=device),
            length=torch.zeros(rows, dtype=torch.long, device=device),
            counts=torch.zeros(rows, vocab, dtype=torch.float32, device=device) if counted else None,
            match=torch.zeros(rows, _FIRST_CAPACITY, dtype=torch.int32, device=device) if dry else None,
            scratch=torch.zeros(rows, vocab, dtype=torch.float32, device=device) if dry else None,
            window=-1 if any(s.repeat_last_n < 0 for s in settings) else max(s.repeat_last_n for s in settings),
        )

    # ------------------------------------------------------------------------------------------------- apply
    def apply(self, logits: torch.Tensor) -> None:
        """Penalise `logits` (B, V) in place: the row's next-token scores before temperature and truncation.
        A token a grammar masked (-inf) stays masked.

        Only the logits of tokens in a row's history are read and written (gather, scatter), never the whole
        vocabulary: a pass over (B, V) costs more than everything else here. A token's new logit depends on the
        token alone, so a token at several positions is written the same value from each."""
        if self.counted:
            self._apply_counted(logits)
        if self.dry:
            self._apply_dry(logits)

    def _apply_counted(self, logits: torch.Tensor) -> None:
        assert self.counts is not None
        span = self.bound if self.window < 0 else min(self.bound, self.window)
        if span == 0:
            return
        p = self.params
        # The last `span` positions of every row hold every token of its window (and maybe older ones, whose count
        # in the window is 0 unless they are in it too: then they are written what the window's copy is written).
        offsets = torch.arange(span, device=logits.device)
        tokens = self.history.gather(1, (self.length[:, None] - span + offsets).clamp(min=0))
        count = self.counts.gather(1, tokens)
        old = logits.gather(1, tokens).float()
        repeated = torch.where(old < 0, old * p.repetition[:, None], old / p.repetition[:, None])
        penalised = repeated - p.presence[:, None] - p.frequency[:, None] * count
        logits.scatter_(1, tokens, torch.where(count > 0, penalised, old).to(logits.dtype))

    def _apply_dry(self, logits: torch.Tensor) -> None:
        """Each token that would extend a repeat loses DRY's penalty for the longest such repeat."""
        assert self.match is not None and self.params.breakers is not None and self.scratch is not None
        p = self.params
        width = min(self.history.shape[1], self.bound + 1)
        history, length = self.history[:, :width], self.length
        positions = torch.arange(width - 1, device=history.device)
        start = torch.where(p.dry_last_n < 0, 0, (length - p.dry_last_n).clamp(min=0))
        following = history[:, 1:]  # the token after each position: the one that would extend its repeat
        in_window = (positions[None] >= start[:, None]) & (positions[None] < (length - 1)[:, None])
        candidate = in_window & ~p.breakers.gather(1, following)
        repeat = torch.minimum(self.match[:, : width - 1].long(), positions[None] - start[:, None] + 1)
        allowed = p.dry_allowed[:, None]
        exponent = ((repeat - allowed).float() * p.dry_log_base[:, None]).clamp(max=_MAX_LOG)
        penalty = (p.dry_multiplier[:, None] * exponent.exp()).clamp(max=_MAX_PENALTY)
        penalty = torch.where(candidate & (repeat >= allowed) & (repeat > 0), penalty, 0.0)
        # The largest penalty per token (a longer repeat's, as the penalty grows with the length): reduced into a
        # zeroed (B, V) scratch, read back at the same positions, and the scratch zeroed there again.
        self.scratch.scatter_reduce_(1, following, penalty, reduce="amax")
        largest = self.scratch.gather(1, following)
        self.scratch.scatter_(1, following, 0.0)
        old = logits.gather(1, following).float()
        logits.scatter_(1, following, (old - largest).to(logits.dtype))

    # ------------------------------------------------------------------------------------------------ append
    def append(self, tokens: torch.Tensor, counts: torch.Tensor) -> None:
        """Add the first `counts[b]` tokens of `tokens[b]` (B, W) to row b's history: what each row emitted this
        step that its penalties see (0 for a tool's output and for a finished row)."""
        width = tokens.shape[1]
        self._ensure_capacity(self.bound + width)
        self.bound += width
        for j in range(width):  # a width above 1 only on a fast-forward step (a known run)
            self._append_one(tokens[:, j], counts > j)

    def _append_one(self, token: torch.Tensor, on: torch.Tensor) -> None:
        history, length, p = self.history, self.length, self.params
        if self.counted:
            assert self.counts is not None
            window = p.repeat_last_n
            counted = on & (window != 0)
            self.counts.scatter_add_(1, token[:, None], counted[:, None].float())
            leaving = length - window  # the token that falls out of a window of `window` tokens
            drop = counted & (window > 0) & (leaving >= 0)
            old = history.gather(1, leaving.clamp(min=0)[:, None])
            self.counts.scatter_add_(1, old, -drop[:, None].float())
        if self.dry:
            assert self.match is not None and p.breakers is not None
            positions = torch.arange(history.shape[1], device=history.device)
            extends = (history == token[:, None]) & (positions[None] < length[:, None])
            extends &= ~p.breakers.gather(1, token[:, None])
            before = torch.nn.functional.pad(self.match[:, :-1], (1, 0))
            grown = torch.where(extends, before + 1, 0)
            self.match = torch.where(on[:, None], grown, self.match)
        kept = history.gather(1, length[:, None])
        history.scatter_(1, length[:, None], torch.where(on, token, kept[:, 0])[:, None])
        self.length = length + on

    def _ensure_capacity(self, needed: int) -> None:
        capacity = self.history.shape[1]
        if needed < capacity:  # one slot always spare: `_append_one` reads the slot at `length`
            return
        extra = max(capacity, needed + 1 - capacity)
        self.history = torch.nn.functional.pad(self.history, (0, extra))
        if self.match is not None:
            self.match = torch.nn.functional.pad(self.match, (0, extra))

    @classmethod
    def join(cls, parts: Sequence[tuple[PenaltyState | None, int]]) -> PenaltyState | None:
        """Several batches' rows side by side (rows admitted into a running batch), from each batch's state (None:
        no row of it has a penalty) and its number of rows; None when no part has a penalty. A row without a
        penalty gets neutral parameters, and zeros for what the others keep (counts, DRY's matches): its logits are
        left as they are, as in a batch of its own."""
        states = [state for state, _ in parts if state is not None]
        if not states:
            return None
        counted, dry = any(s.counted for s in states), any(s.dry for s in states)
        first = states[0]
        device = first.history.device
        vocab = (first.counts if first.counts is not None else first.scratch).shape[1]  # one of them is kept
        capacity = max(s.history.shape[1] for s in states)

        def rows_of(part: tuple[PenaltyState | None, int], name: str, width: int, dtype: torch.dtype) -> torch.Tensor:
            state, rows = part
            kept = None if state is None else getattr(state, name)
            if kept is None:
                return torch.zeros(rows, width, dtype=dtype, device=device)
            return torch.nn.functional.pad(kept, (0, width - kept.shape[1])) if kept.shape[1] < width else kept

        def params_of(part: tuple[PenaltyState | None, int]) -> PenaltyParams:
            state, rows = part
            if state is not None:
                return state.params
            ones, zeros = torch.ones(rows, device=device), torch.zeros(rows, device=device)
            none = torch.zeros(rows, dtype=torch.long, device=device)
            return PenaltyParams(
                repetition=ones, presence=zeros, frequency=zeros, repeat_last_n=none, dry_multiplier=zeros,
                dry_log_base=zeros, dry_allowed=none + 1, dry_last_n=none, breakers=None,
            )  # fmt: skip

        params = [params_of(part) for part in parts]
        joined = {
            name: torch.cat([getattr(p, name) for p in params])
            for name in PenaltyParams.__dataclass_fields__
            if name != "breakers"
        }
        breakers = None
        if dry:
            breakers = torch.cat([torch.zeros(rows, vocab, dtype=torch.bool, device=device) if p.breakers is None
                                  else p.breakers for p, (_, rows) in zip(params, parts, strict=True)])  # fmt: skip
        total = sum(rows for _, rows in parts)
        return cls(
            params=PenaltyParams(**joined, breakers=breakers),
            counted=counted,
            dry=dry,
            history=torch.cat([rows_of(part, "history", capacity, torch.long) for part in parts]),
            length=torch.cat([torch.zeros(rows, dtype=torch.long, device=device) if s is None else s.length
                              for s, rows in parts]),
            counts=torch.cat([rows_of(part, "counts", vocab, torch.float32) for part in parts]) if counted else None,
            match=torch.cat([rows_of(part, "match", capacity, torch.int32) for part in parts]) if dry else None,
            scratch=torch.zeros(total, vocab, dtype=torch.float32, device=device) if dry else None,
            window=-1 if any(s.window < 0 for s in states) else max(s.window for s in states),
            bound=max(s.bound for s in states),
        )

    def select(self, index: torch.Tensor) -> PenaltyState:
        """The state of rows `index` (batch compaction)."""
        return replace(
            self,
            params=self.params.select(index),
            history=self.history.index_select(0, index),
            length=self.length.index_select(0, index),
            counts=None if self.counts is None else self.counts.index_select(0, index),
            match=None if self.match is None else self.match.index_select(0, index),
            scratch=None if self.scratch is None else self.scratch.index_select(0, index),
        )


def breaker_mask_for(token_bytes: Callable[[int], bytes], vocab: int, device: torch.device) -> BreakerMask:
    """A `BreakerMask` over a vocabulary of `vocab` ids whose bytes `token_bytes` gives; each set of breakers is
    looked up once (one pass over the vocabulary, ~50 ms) and kept."""
    cache: dict[tuple[str, ...], torch.Tensor] = {}

    def mask(breakers: tuple[str, ...]) -> torch.Tensor:
        if breakers not in cache:
            needles = [b.encode("utf-8") for b in breakers]
            flags = [any(n in token_bytes(t) for n in needles) for t in range(vocab)] if needles else [False] * vocab
            cache[breakers] = torch.tensor(flags, dtype=torch.bool, device=device)
        return cache[breakers]

    return mask
