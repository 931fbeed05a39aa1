"""Random STT models whose routers behave as if trained, for tests and benchmarks.

A freshly initialised causal router predicts the configured capacity for every token (its output bias is the
capacity's logit and its weights are small), so every token lands on the same side of the threshold and routing
looks all-or-nothing. Spreading the router weights makes decisions depend on the token and its predecessor, so
roughly half the tokens run each STT layer — the regime the engine, the cache and the UI must handle.
"""

from __future__ import annotations

from pathlib import Path

import torch

from chatapp.stt.config import STTConfig
from chatapp.stt.model import STTForCausalLM


def spread_routers(model: STTForCausalLM, std: float = 0.5) -> STTForCausalLM:
    """Give every causal router spread-out weights and a zero output bias, and every skip predictor random weights
    (in place; uses torch's global RNG)."""
    with torch.no_grad():
        for index in model.stt_layer_indices:
            router = model.model.layers[index].causal_router
            router.up.weight.normal_(std=std)
            router.out.weight.normal_(std=std)
            router.out.bias.zero_()
        for index in model.stt_layer_indices:  # after the routers: those are the same whatever the skip mode
            predictor = model.model.layers[index].skip_predictor
            if predictor is not None:  # "predict" mode: an update of about the size of a block's residual
                predictor.down.weight.normal_(std=std / predictor.down.in_features**0.5)
                predictor.up.weight.normal_(std=std / predictor.up.in_features**0.5)
                predictor.up.bias.normal_(std=0.1 * std)
    return model


def random_routed_model(config: STTConfig, seed: int = 0, std: float = 0.5) -> STTForCausalLM:
    """A seeded random model (eval mode) with spread routers; `config.routing_trained` should be True."""
    torch.manual_seed(seed)
    return spread_routers(STTForCausalLM(config).eval(), std=std)


def save_random_model_dir(directory: Path, config: STTConfig, tokenizer, seed: int = 0) -> Path:
    """Write a loadable model directory (config.json, model.safetensors, tokenizer.json) of a random routed model."""
    directory = Path(directory)
    random_routed_model(config, seed=seed).save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory
