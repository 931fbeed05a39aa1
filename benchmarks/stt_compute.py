"""Does skipping tokens in STT layers save wall-clock time? Routed inference vs routing off, same weights.

Block-dominated shape (hidden 1024, 12 layers, vocab 512, random weights; STT layers 1, 3, ..., 11). Prefill of
4 rows x 512 tokens, then 128 decode steps, with the STT layers' selection forced to capacity γ = 1, 0.75, 0.5,
0.25 by a deterministic pattern, against routing off. The pattern replaces the causal router's decision after
the router itself has run (its cost stays in), and differs per row and per layer (a golden-ratio sequence over
position, row and layer), so rows do not skip in lockstep. Ideal speed-up with half the layers routed at γ:
1 / ((1 + γ) / 2) (linear FLOPs; attention scales with γ² in STT layers, so prefill can even beat it slightly).

Run: .venv/bin/python benchmarks/stt_compute.py [--repeats N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch
from torch.utils.flop_counter import FlopCounterMode

from chatapp.stt import ExtendOutput, KVCache, STTConfig, STTForCausalLM
from chatapp.stt import decode as fast_decode
from chatapp.stt.layers import STTLayer

SHAPE = dict(
    vocab_size=512,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
ROWS, PROMPT, DECODE = 4, 512, 128
CAPACITIES = (1.0, 0.75, 0.5, 0.25)
GOLDEN = 0.6180339887498949


class ForcedRouting(STTForCausalLM):
    """An STT model whose routing decision is a fixed pattern with a chosen selected fraction.

    The causal router still runs (its cost stays in); only its decision is replaced, in `extend` and in the
    decode fast path (`chatapp.stt.decode.router_probs`, patched for the duration of a decode call).
    """

    capacity = 1.0

    def pattern(self, positions: torch.Tensor, stt_slot: int) -> torch.Tensor:
        """1.0 where token (row, position) is selected in STT layer `stt_slot`, else 0.0; shape of `positions`."""
        rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
        phase = ((positions + 7 * rows + 13 * stt_slot).double() * GOLDEN) % 1.0
        return (phase < self.capacity).float()

    def _router_probs(
        self, layer: STTLayer, hidden: torch.Tensor, lengths: torch.Tensor, cache: KVCache, stt_slot: int
    ) -> torch.Tensor:
        super()._router_probs(layer, hidden, lengths, cache, stt_slot)
        positions = cache.seen[:, None] + torch.arange(hidden.shape[1], device=hidden.device)[None, :]
        return self.pattern(positions, stt_slot)

    def decode(self, ids: torch.Tensor, cache: KVCache, **kwargs) -> ExtendOutput:
        slots = {id(self.model.layers[index]): slot for slot, index in enumerate(self.stt_layer_indices)}
        router = fast_decode.router_probs

        def forced(layer: STTLayer, x: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
            router(layer, x, previous)
            return self.pattern(cache.seen[:, None], slots[id(layer)])[:, 0]

        with mock.patch.object(fast_decode, "router_probs", forced):
            return super().decode(ids, cache, **kwargs)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def prefill_once(model: ForcedRouting, ids: torch.Tensor, routing: str) -> tuple[float, KVCache, torch.Tensor, float]:
    """(seconds, filled cache, last logits, fraction of STT-layer tokens computed) of one prefill."""
    cache = model.new_cache(ids.shape[0], ids.shape[1] + DECODE)
    lengths = torch.full((ids.shape[0],), ids.shape[1], device=ids.device)
    sync(ids.device)
    start = time.perf_counter()
    out = model.extend(ids, lengths, cache, routing=routing)
    sync(ids.device)
    return time.perf_counter() - start, cache, out.logits, float(out.selected.float().mean())


def decode_once(model: ForcedRouting, cache: KVCache, logits: torch.Tensor, routing: str) -> tuple[float, float]:
    """(seconds, fraction computed) of DECODE greedy steps after a prefill."""
    token = logits.argmax(-1)
    selected = []
    start = time.perf_counter()
    for _ in range(DECODE):
        step = model.decode(token, cache, routing=routing)
        token = step.logits.argmax(-1)
        selected.append(step.selected.float().mean())
    sync(token.device)
    return time.perf_counter() - start, float(torch.stack(selected).mean())


def prefill_flops(model: ForcedRouting, ids: torch.Tensor, routing: str) -> float:
    """Floating-point operations of one prefill (counted by torch, so free of timing noise)."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    with FlopCounterMode(display=False) as counter:
        model.extend(ids, torch.full((ids.shape[0],), ids.shape[1], device=ids.device), cache, routing=routing)
    return float(counter.get_total_flops())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="Best of N interleaved prefill passes.")
    parser.add_argument("--decode-repeats", type=int, default=1, help="Best of N interleaved decode passes.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = ForcedRouting(STTConfig(**SHAPE, routing_trained=True)).to(device).eval()
    ids = torch.randint(0, SHAPE["vocab_size"], (ROWS, PROMPT), device=device)
    prefill_once(model, ids[:, :64], "off")  # warm-up (allocator, kernels)

    # Configurations are interleaved within each pass so that load from other processes hits them alike.
    configs = [("off", 1.0)] + [("student", c) for c in CAPACITIES]
    best: dict[float | str, list[float]] = {}
    for repeat in range(max(args.repeats, args.decode_repeats)):
        for routing, capacity in configs:
            model.capacity = capacity
            key = "off" if routing == "off" else capacity
            prefill, cache, logits, computed = prefill_once(model, ids, routing)
            decode = float("inf")
            if repeat < args.decode_repeats:
                decode, decode_computed = decode_once(model, cache, logits, routing)
                computed = (computed * PROMPT + decode_computed * DECODE) / (PROMPT + DECODE)
            if repeat >= args.repeats:
                prefill = float("inf")
            old = best.get(key, [float("inf"), float("inf"), computed])
            best[key] = [min(old[0], prefill), min(old[1], decode), old[2]]
    flops = {}
    for routing, capacity in configs:
        model.capacity = capacity
        flops["off" if routing == "off" else capacity] = prefill_flops(model, ids[:1], routing)

    base_prefill, base_decode, _ = best["off"]
    print(
        f"STT compute: {device}, {torch.get_num_threads()} threads, best of {args.repeats} prefills / "
        f"{args.decode_repeats} decodes; {ROWS}x{PROMPT} prefill "
        f"+ {DECODE} decode steps; hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers (6 STT)"
    )
    header = (
        f"{'routing':<12}{'computed':>9}{'FLOPs':>7}{'prefill s':>11}{'speed-up':>10}{'ideal':>7}{'of ideal':>10}"
        f"{'decode s':>10}{'speed-up':>10}"
    )
    print(header)
    print("-" * len(header))
    for routing, capacity in configs:
        key = "off" if routing == "off" else capacity
        prefill, decode, computed = best[key]
        ideal = 1 / ((1 + capacity) / 2) if routing == "student" else 1.0
        speedup = base_prefill / prefill
        label = "off" if routing == "off" else f"γ = {capacity:.2f}"
        print(
            f"{label:<12}{computed:>9.2f}{flops[key] / flops['off']:>7.2f}{prefill:>11.2f}{speedup:>10.2f}"
            f"{ideal:>7.2f}{speedup / ideal:>10.0%}{decode:>10.2f}{base_decode / decode:>10.2f}"
        )


if __name__ == "__main__":
    main()
