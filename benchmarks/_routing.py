"""Synthetic routing for the speed benchmarks (not a benchmark itself: `make bench` skips files starting with `_`).

A model whose own routers barely skip cannot show what skipping is worth in speed. `route_synthetically` makes a
chosen set of decoder layers the model's STT layers, with causal routers that skip about a chosen share of their
tokens: each router's output bias is set so that the median of its probabilities, over a short text decoded with
that routing, sits at the model's threshold. What the routers pick is arbitrary (fresh random weights for a layer
that had none), so quality means nothing here; only the share skipped does, and the benchmark measures and reports
it rather than trusting the calibration.
"""

from __future__ import annotations

import math

import torch

from chatapp.stt import STTForCausalLM
from chatapp.stt.layers import DecoderBlock, STTLayer


def _as_stt_layer(block: DecoderBlock, model: STTForCausalLM) -> STTLayer:
    """`block` as an STT layer with the same block weights and fresh routers (seeded by the caller)."""
    layer = STTLayer(model.config).to(device=block.input_layernorm.weight.device)
    missing, unexpected = layer.load_state_dict(block.state_dict(), strict=False)
    assert not unexpected and all(".".join(k.split(".")[:1]) in ("transition_network", "predictive_router",
                                                                 "causal_router") for k in missing), missing
    with torch.no_grad():  # spread weights, so that decisions depend on the token (`stt.random_init`)
        layer.causal_router.up.weight.normal_(std=0.5)
        layer.causal_router.out.weight.normal_(std=0.5)
    return layer.eval()


def _as_dense_block(layer: STTLayer, model: STTForCausalLM) -> DecoderBlock:
    block = DecoderBlock(model.config)
    block.self_attn, block.mlp = layer.self_attn, layer.mlp
    block.input_layernorm, block.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
    return block.eval()


def route_synthetically(
    model: STTForCausalLM,
    layers: list[int],
    rate: float,
    skip_mode: str,
    prompt: list[int],
    new_tokens: int = 64,
    rounds: int = 4,
    seed: int = 0,
) -> STTForCausalLM:
    """Make exactly `layers` the STT layers of the float32 `model` (in place, before any weight format), in
    `skip_mode`, with routers that skip about `rate` of the tokens of a greedy decode of `new_tokens` after
    `prompt` (ids) with that routing: the decode a speed benchmark times.

    Layers already STT layers keep their routers' weights (only the output bias moves); STT layers not in `layers`
    become dense blocks. The bias is calibrated in `rounds` passes, since a layer's inputs, and the tokens, move as
    the layers before it start skipping."""
    torch.manual_seed(seed)
    config = model.config
    for index, layer in enumerate(model.model.layers):
        if index in layers and not isinstance(layer, STTLayer):
            model.model.layers[index] = _as_stt_layer(layer, model)
        elif index not in layers and isinstance(layer, STTLayer):
            model.model.layers[index] = _as_dense_block(layer, model)
    config.stt_layers = sorted(layers)
    config.skip_mode = skip_mode
    config.train_causal_router = True
    config.routing_trained = True
    # The decode step's plans follow which layers are STT layers: derived again from these (`stt.decode.decode_plan`).
    model.runtime.plans.clear()
    model.runtime.readers.clear()
    target = math.log(config.router_threshold / (1 - config.router_threshold))
    for _ in range(rounds):
        probs = decoded_router_probs(model, prompt, new_tokens)  # (L_stt, T)
        logits = torch.logit(probs.clamp(1e-6, 1 - 1e-6))
        # Skip `rate`: the `rate` quantile of each layer's logits moves onto the threshold's logit.
        shift = target - torch.quantile(logits, rate, dim=1)
        with torch.no_grad():
            for slot, index in enumerate(config.stt_layers):
                model.model.layers[index].causal_router.out.bias += shift[slot].item()
    return model


@torch.no_grad()
def decoded_router_probs(model: STTForCausalLM, prompt: list[int], new_tokens: int) -> torch.Tensor:
    """Router probabilities (L_stt, new_tokens) of a greedy decode after `prompt` with the student's routing (so
    each layer sees the inputs the routed layers before it leave), as the engine decodes it."""
    cache = model.new_cache(1, len(prompt) + new_tokens + 1)
    logits = model.extend(torch.tensor([prompt]), torch.tensor([len(prompt)]), cache, routing="student").logits
    probs = []
    for _ in range(new_tokens):
        out = model.decode(logits.argmax(-1), cache, routing="student")
        probs.append(out.router_probs[:, 0, 0])
        logits = out.logits
    return torch.stack(probs, 1)
