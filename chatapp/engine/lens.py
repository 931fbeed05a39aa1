"""What each layer made of a reply's tokens, as plain data: the logit lens's results (`chatapp.engine.lens_pass`
computes them; `chatapp.stt.lens` has the maths).

For every emitted token the lens reads the hidden states of the position that predicted it (the token before it),
after every decoder layer, through the final norm and the LM head. A routed layer that skipped that position left
its state unchanged, so its reading repeats the layer below's ("strict" and "kv" alike; in "kv" mode the skipped
token's K/V still reached later tokens' attention, which the replay reproduces).

The decision depth of a token is the first layer from which the lens's top token stays the emitted one: how deep
the model had to go before the answer was settled. `ReplyLens.layer_depths` asks the STT's question of it: do the
tokens a routed layer skips tend to be the ones already settled below it?

No torch here: the TUI's process receives these from its engine process and draws them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LensRequest:
    """What the UI asks its engine for: the lens of one answer of the conversation (its tokens, and the routing
    each had when it was fed), with the per-layer table of token `detail`."""

    answer: int  # which assistant message of the conversation (0: the first)
    tokens: tuple[int, ...]
    computed: tuple[tuple[bool, ...] | None, ...]  # per token, as `TokenEvent.computed`
    detail: int | None = None


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

    def token(self, index: int) -> TokenLens | None:
        return self.tokens[index] if 0 <= index < len(self.tokens) else None

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


DEPTH_BLOCKS = " ▁▂▃▄▅▆▇█"  # a deeper (later) decision draws a taller block


def depth_block(depth: int | None, num_layers: int) -> str:
    """One character for a decision depth, in the CLI's table and the heatmap's depth row: the first layer draws the
    lowest block, the last layer a full one; no decision (the model ranked another token first) is blank."""
    if depth is None:
        return " "
    steps = len(DEPTH_BLOCKS) - 2
    return DEPTH_BLOCKS[1 + round(depth / max(num_layers - 1, 1) * steps)]
