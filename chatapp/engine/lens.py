"""What each layer made of a reply's tokens: the logit lens (`chatapp.stt.lens`) over a conversation, as plain data.

For every emitted token the lens reads the hidden states of the position that predicted it (the token before it),
after every decoder layer, through the final norm and the LM head. A routed layer that skipped that position left
its state unchanged, so its reading repeats the layer below's ("strict" and "kv" alike; in "kv" mode the skipped
token's K/V still reached later tokens' attention, which the forward reproduces). Which layers computed is the
routing the reply actually had (`TokenEvent.computed`, `PromptInfo.computed`), replayed by one forward over the
prefix; the causal router decides only where no decision was recorded (a teacher-forced reply).

The decision depth of a token is the first layer from which the lens's top token stays the emitted one: how deep
the model had to go before the answer was settled. `ReplyLens.layer_depths` asks the STT's question of it: do the
tokens a routed layer skips tend to be the ones already settled below it?

This runs on demand (the `chatapp lens` command, the TUI's layers view), never on the decode path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chatapp.errors import SettingsError
from chatapp.stt.lens import LensHead, Translators, capture_states, decision_depths, read_layers

if TYPE_CHECKING:
    from chatapp.engine.engine import Engine
    from chatapp.engine.reply import Reply

DEFAULT_TOP = 3  # alternatives per layer in a table


@dataclass(frozen=True, slots=True)
class LensAlternative:
    """A token a layer's reading ranks high, with its probability under that reading."""

    token: int
    text: str
    prob: float


@dataclass(frozen=True, slots=True)
class LayerLens:
    """One decoder layer's reading at the position that predicted a token."""

    layer: int
    routed: bool  # an STT layer (its block runs only for the tokens its router selects)
    computed: bool  # the block ran for that position (always, in a dense layer)
    prob: float  # of the emitted token
    rank: int  # of the emitted token (1: the reading's top token)
    top: tuple[LensAlternative, ...]


@dataclass(frozen=True, slots=True)
class TokenLens:
    """The lens of one emitted token."""

    index: int  # the token's index among the tokens asked about (a reply's token index)
    position: int  # its position in the conversation's ids
    token: int
    text: str
    decision_depth: int | None  # first layer from which the top reading stays this token; None: never settled
    computed: tuple[bool, ...]  # per STT layer: computed at the predicting position (`ReplyLens.stt_layers` order)
    layers: tuple[LayerLens, ...] = ()  # every layer's reading, when a table was asked for this token


@dataclass(frozen=True, slots=True)
class DepthSplit:
    """One routed layer's share of the decision depths: mean depth of the tokens it skipped vs those it computed."""

    layer: int
    skipped: float | None
    computed: float | None
    skipped_tokens: int
    computed_tokens: int


@dataclass(frozen=True, slots=True)
class ReplyLens:
    """The lens over a run of emitted tokens."""

    lens: str  # "raw" (the model's own head) or "tuned" (per-layer translators first)
    num_layers: int
    stt_layers: tuple[int, ...]
    skip_mode: str
    tokens: tuple[TokenLens, ...]

    def layer_depths(self) -> list[DepthSplit]:
        """Per STT layer: the mean decision depth of the tokens it skipped and of those it computed (settled tokens
        only)."""
        splits = []
        for slot, layer in enumerate(self.stt_layers):
            skipped = [t.decision_depth for t in self.tokens if t.decision_depth is not None and not t.computed[slot]]
            computed = [t.decision_depth for t in self.tokens if t.decision_depth is not None and t.computed[slot]]
            splits.append(
                DepthSplit(
                    layer,
                    sum(skipped) / len(skipped) if skipped else None,
                    sum(computed) / len(computed) if computed else None,
                    len(skipped),
                    len(computed),
                )
            )
        return splits


def conversation_lens(
    engine: Engine,
    ids: Sequence[int],
    computed: Sequence[Sequence[bool] | None] | None,
    targets: Sequence[int],
    *,
    tables: Sequence[int] = (),
    dense: bool = False,
    threshold: float | None = None,
    translators: Translators | None = None,
    top: int = DEFAULT_TOP,
) -> ReplyLens:
    """The lens of the tokens at positions `targets` (each >= 1) of the conversation `ids`.

    `computed[p]`: per STT layer, whether it ran for the token at position p (None for a token, or for all of them:
    the causal router decides); `dense`: routing was off. `tables`: indices into `targets` whose every layer's
    reading (with the top `top` tokens) is returned, not only the decision depth.
    """
    model = engine.model
    length = len(ids)
    if not targets:
        raise SettingsError("the lens has no tokens to explain", hint="give at least one reply token")
    if any(not 1 <= p < length for p in targets):
        raise SettingsError(f"lens positions must be within 1..{length - 1}", hint="explain tokens of the conversation")
    for index in tables:
        if not 0 <= index < len(targets):
            raise SettingsError(f"token {index} is not among the {len(targets)} tokens explained")
    stt_layers = tuple(model.stt_layer_indices)
    decisions, known = _decisions(computed, length, len(stt_layers))
    reads = torch.tensor([p - 1 for p in targets])
    emitted = torch.tensor([ids[p] for p in targets])
    captured = capture_states(
        model,
        torch.tensor(list(ids)),
        reads,
        decisions=decisions,
        known=known,
        dense=dense,
        threshold=threshold,
    )
    head = LensHead(model, translators)
    depths = decision_depths(head, captured.states, emitted).tolist()
    flags = captured.selected[:, reads.to(captured.selected.device)].T.cpu().tolist()  # (P, L_stt)
    detail = sorted(set(tables))
    table_rows = {}
    if detail:
        table = read_layers(head, captured.states[:, detail], emitted[detail], top)
        table_rows = {index: row for row, index in enumerate(detail)}
    text = _token_text(engine)
    tokens = []
    for i, position in enumerate(targets):
        layers: tuple[LayerLens, ...] = ()
        if i in table_rows:
            row = table_rows[i]
            layers = _layer_rows(table, row, model.config.num_hidden_layers, stt_layers, flags[i], text)
        token = int(ids[position])
        tokens.append(
            TokenLens(
                index=i,
                position=position,
                token=token,
                text=text(token),
                decision_depth=None if depths[i] < 0 else int(depths[i]),
                computed=tuple(bool(f) for f in flags[i]),
                layers=layers,
            )
        )
    return ReplyLens(
        lens=head.kind,
        num_layers=int(model.config.num_hidden_layers),
        stt_layers=stt_layers,
        skip_mode=str(getattr(model.config, "skip_mode", "strict")),
        tokens=tuple(tokens),
    )


def reply_lens(
    engine: Engine,
    prompt_ids: Sequence[int],
    reply: Reply,
    prompt_computed: Sequence[Sequence[bool]] | None,
    *,
    tables: Sequence[int] = (),
    dense: bool = False,
    threshold: float | None = None,
    translators: Translators | None = None,
    top: int = DEFAULT_TOP,
) -> ReplyLens:
    """The lens of every token `reply` emitted after `prompt_ids` (a final stop token included), with the routing
    the prompt (`PromptInfo.computed` for its row; None with routing off) and the reply had."""
    tokens = [event.token for event in reply.events]
    ids = [*prompt_ids, *tokens]
    computed: list[Sequence[bool] | None] = [*(prompt_computed or [None] * len(prompt_ids))]
    computed += [event.computed for event in reply.events]
    targets = list(range(len(prompt_ids), len(ids)))
    return conversation_lens(
        engine,
        ids,
        computed,
        targets,
        tables=tables,
        dense=dense,
        threshold=threshold,
        translators=translators,
        top=top,
    )


def _decisions(
    computed: Sequence[Sequence[bool] | None] | None, length: int, layers: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Recorded routing as (L_stt, T) decisions and the (T,) positions where they were recorded."""
    if computed is None or layers == 0:
        return None, None
    decisions = torch.zeros(layers, length, dtype=torch.bool)
    known = torch.zeros(length, dtype=torch.bool)
    for position, flags in enumerate(computed[:length]):
        if flags is None:
            continue
        if len(flags) != layers:
            raise SettingsError(f"token {position} has routing for {len(flags)} layers, the model routes {layers}")
        decisions[:, position] = torch.tensor([bool(f) for f in flags])
        known[position] = True
    return decisions, known


def _token_text(engine: Engine):
    """A token's text as the transcript shows it (a special token's name; invalid UTF-8 replaced)."""
    pieces = engine.token_bytes

    def text(token: int) -> str:
        return pieces(int(token)).decode("utf-8", errors="replace")

    return text


def _layer_rows(table, row: int, num_layers: int, stt_layers: tuple[int, ...], flags, text) -> tuple[LayerLens, ...]:
    slots = {layer: slot for slot, layer in enumerate(stt_layers)}
    prob, rank = table.prob[row].tolist(), table.rank[row].tolist()
    top_ids, top_probs = table.top_ids[row].tolist(), table.top_probs[row].tolist()
    return tuple(
        LayerLens(
            layer=layer,
            routed=layer in slots,
            computed=bool(flags[slots[layer]]) if layer in slots else True,
            prob=prob[layer],
            rank=int(rank[layer]),
            top=tuple(LensAlternative(t, text(t), p) for t, p in zip(top_ids[layer], top_probs[layer], strict=True)),
        )
        for layer in range(num_layers)
    )
