"""The model's forward: the one loop over its layers that every pass runs, as gpt-fast's `forward(x, input_pos)`.

    ids ─► embed ─► rotary at the tokens' absolute positions
        ─► per layer:  policy(index, layer, x) ─► None: every token runs the block (dense)
                                               └► (B, T) bool: the tokens it runs (routed; the others skip)
                       back-end runs the layer: `dense` or `routed`          (`after`: a pass's own look at x → y)
        ─► final norm ─► LM head, at the positions the pass reads

What differs between passes is passed in, never written again:
- the back-end (`LayerRunner`): `SequenceLayers` attends within the given sequences, with no cache and gradients
  allowed (teacher training and evaluation: `stt.teacher`; routing fits and tunes: `chatapp.training.route`,
  `chatapp.training.tune`); the KV cache's (`STTForCausalLM.extend`: prefill, and the ragged steps of the torch
  path) appends each layer's K/V to the cache and attends over it, running a routed layer's block for its selected
  tokens only.
- the policy (`Policy`): per layer, dense; routed by its causal router at a threshold; gated by the teacher's
  targets; or a given mask (a routing fit's decisions, the tune's).
- what to keep: every layer's input (`inputs`, a routing fit's dense pass), or what `after` takes of each output (the
  teacher's signals, the lens's states).
What a skipped token carries on is one rule (`layers.skipped_output`), in every back-end.

A decode step of one token per row has back-ends of their own, scheduled for speed rather than written as this
loop: the native step on a CPU (`stt.cpu_step`, one C call) and the torch step (`stt.decode`, layers in compiled
stacks). Both run the same per-layer rules, and tests compare them with this forward token by token
(tests/stt/test_fast_paths.py, tests/stt/test_gemv.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from chatapp.stt.layers import self_attention_sink

# Per layer, the tokens it runs (B, T) bool, or None for every token; read from the layer's input `x`.
Policy = Callable[[int, nn.Module, torch.Tensor], "torch.Tensor | None"]
# Per layer, after it ran: (index, layer, its input, its output) -> the output the next layer reads.
After = Callable[[int, nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class LayerRunner(Protocol):
    """How a back-end runs one layer over the hidden states (B, T, D)."""

    def dense(self, index: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...
    def routed(self, index: int, layer: nn.Module, hidden: torch.Tensor, selected: torch.Tensor) -> torch.Tensor: ...


def run_layers(
    model: nn.Module,
    hidden: torch.Tensor,
    runner: LayerRunner,
    policy: Policy | None = None,
    *,
    start: int = 0,
    after: After | None = None,
    inputs: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """The layers from `start` on, over `hidden` (B, T, D): each dense or routed as `policy` says, run by `runner`.
    `inputs`, when given, receives every layer's input and, last, the final hidden state."""
    layers = model.model.layers
    for index in range(start, len(layers)):
        layer, x = layers[index], hidden
        if inputs is not None:
            inputs.append(x)
        selected = None if policy is None else policy(index, layer, x)
        hidden = runner.dense(index, layer, x) if selected is None else runner.routed(index, layer, x, selected)
        if after is not None:
            hidden = after(index, layer, x, hidden)
    if inputs is not None:
        inputs.append(hidden)
    return hidden


def embed(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(hidden, cos, sin): the tokens' embeddings and the rotary tables at their absolute `positions` (B, T)."""
    hidden = model.model.embed_tokens(ids)
    cos, sin = model.model.rotary_emb(hidden, positions)
    return hidden, cos, sin


def head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The logits of hidden states: final norm, then the LM head."""
    return model.lm_head(model.model.norm(hidden))


@dataclass
class SequenceLayers:
    """The back-end of passes over whole sequences without a cache: a layer attends within each sequence (plain
    causal attention; a routed layer with the keys its skip mode leaves: `DecoderBlock.routed`). `predictors`: a
    routed layer's skip predictor to use instead of its own (a routing fit measures them before they join a layer)."""

    cos: torch.Tensor
    sin: torch.Tensor
    skip_mode: str
    predictors: dict[int, nn.Module] = field(default_factory=dict)

    def dense(self, index: int, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return layer.block(hidden, self.cos, self.sin, self_attention_sink())

    def routed(self, index: int, layer: nn.Module, hidden: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        return layer.routed(hidden, self.cos, self.sin, selected, self.skip_mode, self.predictors.get(index))


def sequences(
    model: nn.Module, ids: torch.Tensor, skip_mode: str | None = None
) -> tuple[torch.Tensor, SequenceLayers]:
    """The embeddings of whole sequences `ids` (B, T) from position 0, and the back-end that runs layers over
    them (in `skip_mode`, the model's own by default)."""
    positions = torch.arange(ids.shape[1], device=ids.device)[None, :].expand_as(ids)
    hidden, cos, sin = embed(model, ids, positions)
    return hidden, SequenceLayers(cos, sin, skip_mode or model.config.skip_mode)
