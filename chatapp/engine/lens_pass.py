"""The logit lens over a conversation (`chatapp.stt.lens`), replaying the routing its tokens had, into the plain
data of `chatapp.engine.lens`.

Which layers computed is the routing the reply actually had (`TokenEvent.computed`, `PromptInfo.computed`), replayed
by one forward over the prefix (`stt.lens.capture_states`), or, for an answer still in its chat session's KV cache,
by replaying only the answer's tokens against that cache (`stt.lens.replay_states`); the causal router decides only
where no decision was recorded (a teacher-forced reply, a resumed conversation). `AnswerLens` keeps one answer's
captured states, so that the per-layer table of another of its tokens is a few head products, not another forward.
This runs on demand (the `chatapp lens` command, the TUI's layers view), never on the decode path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from chatapp.engine.lens import LayerLens, LensAlternative, ReplyLens, TokenLens
from chatapp.errors import SettingsError
from chatapp.stt.lens import LensHead, Translators, capture_states, decision_depths, read_layers, replay_states

if TYPE_CHECKING:
    from chatapp.engine.engine import Engine
    from chatapp.engine.reply import Reply

__all__ = ["AnswerLens", "conversation_lens", "reply_lens"]

DEFAULT_TOP = 3  # alternatives per layer in a table
REPLAYED_SKIP_MODES = ("strict", "kv", "predict")  # the skip modes `replay_states` reproduces


class AnswerLens:
    """The lens of the tokens at positions `targets` (each >= 1) of the conversation `ids`, captured once: every
    token's decision depth now, any token's per-layer table on demand (`table`).

    `computed[p]`: per STT layer, whether it ran for the token at position p (None for a token, or for all of them:
    the causal router decides); `dense`: routing was off. `cache`: the KV cache that generated `ids` (a chat
    session's, `ChatSession.cache`); when it holds them and the routing of every position read is known, the read
    positions are replayed against it (`stt.lens.replay_states`: the cost of the answer's tokens, not of the
    conversation) instead of a forward over the whole prefix.
    """

    def __init__(
        self,
        engine: Engine,
        ids: Sequence[int],
        computed: Sequence[Sequence[bool] | None] | None,
        targets: Sequence[int],
        *,
        dense: bool = False,
        threshold: float | None = None,
        translators: Translators | None = None,
        cache=None,
    ) -> None:
        model = engine.model
        length = len(ids)
        if not targets:
            raise SettingsError("the lens has no tokens to explain", hint="give at least one reply token")
        if any(not 1 <= p < length for p in targets):
            raise SettingsError(
                f"lens positions must be within 1..{length - 1}", hint="explain tokens of the conversation"
            )
        self.model = model
        self.stt_layers = tuple(model.stt_layer_indices)
        self.num_layers = int(model.config.num_hidden_layers)
        self.ids = [int(t) for t in ids]
        self.targets = list(targets)
        decisions, known = _decisions(computed, length, len(self.stt_layers))
        reads = torch.tensor([p - 1 for p in self.targets])
        self.emitted = torch.tensor([self.ids[p] for p in self.targets])
        student = not dense and bool(getattr(model, "routing_active", True))
        # The replay carries a skipped token on as its skip path did (`stt.lens.replay_states`) in these modes; any
        # other is read by the forward, whose routed layers are the model's own (`DecoderBlock.routed`).
        replayable = getattr(model.config, "skip_mode", "strict") in REPLAYED_SKIP_MODES
        replayable = replayable and cache is not None and int(cache.seen[0]) > int(reads.max())
        if student:
            replayable = replayable and decisions is not None and bool(known[reads].all())
        if replayable:
            every = torch.ones(len(self.stt_layers), len(reads), dtype=torch.bool)
            selected = decisions[:, reads] if student else every
            self.states = replay_states(model, cache, torch.tensor(self.ids)[reads], reads, selected)
            self.flags = selected.T.tolist()  # (P, L_stt)
        else:
            captured = capture_states(
                model, torch.tensor(self.ids), reads, decisions=decisions, known=known, dense=dense, threshold=threshold
            )
            self.states = captured.states
            self.flags = captured.selected[:, reads.to(captured.selected.device)].T.cpu().tolist()  # (P, L_stt)
        self.replayed = replayable
        self.head = LensHead(model, translators)
        self.depths = decision_depths(self.head, self.states, self.emitted).tolist()
        self.text = _token_text(engine)

    def __len__(self) -> int:
        return len(self.targets)

    def table(self, index: int, top: int = DEFAULT_TOP) -> tuple[LayerLens, ...]:
        """Every layer's reading for token `index` (of the targets), with the top `top` tokens."""
        if not 0 <= index < len(self.targets):
            raise SettingsError(
                f"token {index} is not among the {len(self.targets)} tokens explained",
                hint=f"ask for a token from 0 to {len(self.targets) - 1}",
            )
        table = read_layers(self.head, self.states[:, [index]], self.emitted[[index]], top)
        return _layer_rows(table, 0, self.num_layers, self.stt_layers, self.flags[index], self.text)

    def result(self, tables: Sequence[int] = (), top: int = DEFAULT_TOP) -> ReplyLens:
        """The plain-data lens: every token's decision depth, and the tables of tokens `tables`."""
        detail = {index: self.table(index, top) for index in sorted(set(tables))}
        tokens = tuple(
            TokenLens(
                index=i,
                position=position,
                token=self.ids[position],
                text=self.text(self.ids[position]),
                decision_depth=None if self.depths[i] < 0 else int(self.depths[i]),
                computed=tuple(bool(f) for f in self.flags[i]),
                layers=detail.get(i, ()),
            )
            for i, position in enumerate(self.targets)
        )
        return ReplyLens(
            lens=self.head.kind,
            num_layers=self.num_layers,
            stt_layers=self.stt_layers,
            skip_mode=str(getattr(self.model.config, "skip_mode", "strict")),
            tokens=tokens,
        )


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
    """The lens of the tokens at positions `targets` of `ids` (see `AnswerLens`), with the per-layer tables of the
    tokens `tables` (indices into `targets`)."""
    lens = AnswerLens(engine, ids, computed, targets, dense=dense, threshold=threshold, translators=translators)
    return lens.result(tables, top)


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
            raise SettingsError(
                f"token {position} has routing for {len(flags)} layers, the model routes {layers}",
                hint="pass the routing the reply was generated with, one flag per STT layer",
            )
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
    """Row `row` of a `stt.lens.LensTable` as plain data, one `LayerLens` per decoder layer."""
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
