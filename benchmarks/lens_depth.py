"""The layer lens on held-out chat: does each layer's reading agree with the model, and do routed layers skip the
tokens whose prediction was already settled? The model card's "Lens" numbers.

The held-out half of the conversations `chatapp lens fit` draws (`chatapp/cli/lens.py`,
`held_out_conversations`: the recipe's held-out tool conversations and the model's own answers to general prompts,
interleaved; the fit learns from the first half) are read at every position that predicts an assistant token, with the
model's own routing (`chatapp/stt/lens.py`, `capture_states`). Printed, for the raw lens and the tuned one (the
translators the model ships, `lens.safetensors`):

- per layer, top-1 agreement: the share of positions where the layer's top token is the model's (the last layer's);
- per routed layer, the mean decision depth (first layer from which the top token stays the model's) of the
  positions it skipped and of those it computed. The STT's premise predicts "skipped" shallower than "computed".

Run: .venv/bin/python benchmarks/lens_depth.py [--model NAME|DIR] [--conversations 96]
"""

from __future__ import annotations

import argparse

import torch
from _machine import machine

from chatapp.cli.lens import held_out_conversations
from chatapp.models import load_engine, resolve_model
from chatapp.models.lens_files import lens_translators
from chatapp.stt.lens import LensHead, agreement, capture_states, decision_depths


def held_out_states(engine, conversations) -> tuple[torch.Tensor, torch.Tensor]:
    """States (L, N, D) and the routing (L_stt, N) at every position that predicts an assistant token."""
    states, routing = [], []
    for messages in conversations:
        ids, mask = engine.chat_format.render_conversation(messages, max_tokens=1024)
        reads = [p - 1 for p in range(1, len(ids)) if mask[p]]
        if not reads:
            continue
        captured = capture_states(engine.model, torch.tensor(ids), torch.tensor(reads))
        states.append(captured.states)
        routing.append(captured.selected[:, reads])
    joined = torch.cat(states, dim=1)
    return joined, torch.cat(routing, dim=1).cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", type=int, default=96)
    args = parser.parse_args()
    print(machine())
    engine = load_engine(args.model)
    model = engine.model
    drawn = held_out_conversations(engine, resolve_model(args.model), args.conversations)
    chats = drawn[len(drawn) // 2 :]  # the half the fit measured on
    states, routing = held_out_states(engine, chats)
    heads = {"raw": LensHead(model)}
    translators = lens_translators(resolve_model(args.model), model.config)
    if translators is not None:
        heads["tuned"] = LensHead(model, translators)
    final = LensHead(model)
    last = states.shape[0] - 1
    own = torch.cat([final.logits(last, states[-1, s : s + 256]).argmax(-1) for s in range(0, states.shape[1], 256)])
    print(f"{states.shape[1]} held-out positions in {len(chats)} conversations")
    shares = {kind: agreement(head, states).tolist() for kind, head in heads.items()}
    print("\nlayer  " + "  ".join(f"{kind:>6}" for kind in heads))
    for layer in range(states.shape[0]):
        print(f"{layer:5d}  " + "  ".join(f"{shares[kind][layer]:6.1%}" for kind in heads))
    for kind, head in heads.items():
        depths = decision_depths(head, states, own)
        settled = depths >= 0
        print(
            f"\n{kind} lens: mean decision depth {depths[settled].float().mean():.1f} ({int(settled.sum())} positions)"
        )
        print("routed layer  skipped (n)      computed (n)")
        for slot, layer in enumerate(model.stt_layer_indices):
            ran = routing[slot]
            parts = []
            for mask in (~ran & settled, ran & settled):
                mean = depths[mask].float().mean().item() if mask.any() else float("nan")
                parts.append(f"{mean:5.1f} ({int(mask.sum()):4d})")
            print(f"{layer:12d}  {parts[0]}     {parts[1]}")


if __name__ == "__main__":
    main()
