"""The logit lens over a conversation (`chatapp.stt.lens`): the conversation replayed through the model's own forward,
into the plain data of `chatapp.engine.lens`.

The replay is the engine's own computation, not a second one: the tokens before the first one explained are
prefilled as the engine prefills a prompt (`loop.prefill_row`, the prompt's routing as the model's config says:
`route_prompt`), and every later token is fed as the engine decodes it (`model.decode`, the int8 native step on a
CPU), with every layer's output captured on the way. So a layer that skipped a token when the reply was generated
skips it here, for the same reason (its router, at the reply's threshold, on the same numbers), and the last
layer's reading is the model's own distribution: the logits the step returned, the ones the reply was sampled from.
`AnswerLens` keeps one answer's captured states, so that the per-layer table of another of its tokens is a few head
products, not another replay. This runs on demand (the `chatapp lens` command, the TUI's layers view), never on the
decode path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from chatapp.engine.lens import LayerLens, LensAlternative, ReplyLens, TokenLens
from chatapp.engine.loop import prefill_row, prompt_routing
from chatapp.errors import SettingsError
from chatapp.stt.lens import FinalReading, LensHead, Translators, decision_depths, read_layers

if TYPE_CHECKING:
    from chatapp.engine.engine import Engine
    from chatapp.engine.reply import Reply

__all__ = ["AnswerLens", "conversation_lens", "replay", "reply_lens"]

DEFAULT_TOP = 3  # alternatives per layer in a table


@dataclass(frozen=True)
class Replayed:
    """What the model computed for the tokens at some positions of a conversation, each read by the next token."""

    states: torch.Tensor  # (L, P, D) float32: every decoder layer's output at each position
    final: FinalReading  # the model's own distribution of the next token there, read at the token that came next
    flags: list[list[bool]]  # (P, L_stt): which STT layers computed the token at each position


@torch.inference_mode()
def replay(model, ids: Sequence[int], reads: Sequence[int], routing: str, threshold: float | None) -> Replayed:
    """Replay `ids` through the model as the engine generated them, and keep what it computed at positions `reads`
    (each < len(ids) - 1: its reading is of the token after it): everything up to the first read position is
    prefilled as a prompt, each later token decoded as a reply token, at `routing` ("student" at `threshold`, or
    "off")."""
    first, last, wanted = min(reads), max(reads), set(reads)
    cache = model.new_cache(1, last + 1)

    def keep(position: int, out) -> tuple:
        emitted = torch.tensor([ids[position + 1]])
        return out.states[:, 0], FinalReading.of(out.logits[:1], emitted), out.selected[:, 0, -1]

    out = prefill_row(model, cache, ids[: first + 1], prompt_routing(model, routing), threshold, capture=True)
    kept = {first: keep(first, out)}
    for position in range(first + 1, last + 1):
        token = torch.tensor([ids[position]], dtype=torch.long, device=model.device)
        out = model.decode(token, cache, routing=routing, threshold=threshold, capture=position in wanted)
        if position in wanted:
            kept[position] = keep(position, out)
    states, finals, flags = zip(*(kept[p] for p in reads), strict=True)
    return Replayed(
        states=torch.stack(states, dim=1).float(),
        final=FinalReading.join(list(finals)),
        flags=torch.stack(flags).bool().cpu().tolist(),
    )


class AnswerLens:
    """The lens of the tokens at positions `targets` (each >= 1) of the conversation `ids`, replayed once
    (`replay`): every token's decision depth now, any token's per-layer table on demand (`table`).

    `dense`: routing was off; else the causal routers decide at `threshold` (None: the model's own), as they did
    when the conversation was generated at that threshold.
    """

    def __init__(
        self,
        engine: Engine,
        ids: Sequence[int],
        targets: Sequence[int],
        *,
        dense: bool = False,
        threshold: float | None = None,
        translators: Translators | None = None,
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
        self.emitted = torch.tensor([self.ids[p] for p in self.targets])
        routing = "off" if dense or not getattr(model, "routing_active", True) else "student"
        replayed = replay(model, self.ids, [p - 1 for p in self.targets], routing, threshold)
        self.states, self.final, self.flags = replayed.states, replayed.final, replayed.flags
        self.head = LensHead(model, translators)
        self.depths = decision_depths(self.head, self.states, self.emitted, self.final).tolist()
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
        table = read_layers(self.head, self.states[:, [index]], self.emitted[[index]], top, self.final.at([index]))
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
    lens = AnswerLens(engine, ids, targets, dense=dense, threshold=threshold, translators=translators)
    return lens.result(tables, top)


def reply_lens(
    engine: Engine,
    prompt_ids: Sequence[int],
    reply: Reply,
    *,
    tables: Sequence[int] = (),
    dense: bool = False,
    threshold: float | None = None,
    translators: Translators | None = None,
    top: int = DEFAULT_TOP,
) -> ReplyLens:
    """The lens of every token `reply` emitted after `prompt_ids` (a final stop token included), replayed at the
    routing the reply was generated with (`dense`: off; else the routers at `threshold`)."""
    ids = [*prompt_ids, *(event.token for event in reply.events)]
    targets = list(range(len(prompt_ids), len(ids)))
    return conversation_lens(
        engine, ids, targets, tables=tables, dense=dense, threshold=threshold, translators=translators, top=top
    )


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
