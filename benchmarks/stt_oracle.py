"""Which layers can skip tokens at all? A forward-only oracle over cached layer inputs.

Before training any router, measure the ceiling: for one decoder layer (or a set), skip the 30 / 50 / 70% of the
tokens a *score* rates lowest, and measure held-out perplexity relative to the dense model (routing off)
and a copy probe. The routing is an oracle: it sees the whole sequence and the dense block's output, which no
causal router can, so a layer that hurts here will hurt under any router at that capacity.

Scores (higher = keep the token; the first token, the attention sink, is always processed):

- `dx`: ‖Δx‖² per dimension, Δx = block(x) − x: the block's residual (the spec's D_st);
- `tpn`: ‖Δx − TPN(y_{t−1})‖² per dimension: the layer's transition network's prediction error (D_ch; the TPN
  reads the previous token's block output, as in `chatapp.stt.teacher`); STT layers only;
- `g`: the spec's gate, `PredictiveRouter.gate(D_st, D_ch)` at the end-of-training betas; STT layers only;
- `dxf`: ‖Δx − f(norm(x))‖² per dimension: what the layer's skip predictor f fails to predict ("predict" mode's
  update score, `chatapp.training.route`); with `--ranks`, one score per predictor rank;
- `random`: a seeded uniform draw per layer and token, the baseline any score has to beat.

Skip modes, as `chatapp.stt` defines them: "strict" (a skipped token passes unchanged and is no key in that
layer), "kv" (it passes unchanged, its K/V projected from its unchanged input stay visible) and "predict" ("kv",
and the skipped token carries on with x + f(norm(x))). The routed layer is the model's own `DecoderBlock.routed`
(the block with the mask of `routed_attention_mask(selected, mode)`, exactly what `forward_eval` runs), the other
layers their dense `block`. In "predict" mode f is a rank-r reduced-rank ridge map per layer
(`chatapp.training.predictor`) fitted on `--fit-replies`: a file of the model's own replies as `chatapp route` keeps
them (`routing-data/*.json` in the data directory), none of it held-out text; `--ranks` gives the ranks, and each
rank is a mode of its own ("predict@64"), whose score is `dxf` at that rank.

Efficiency: one dense pass per batch caches every layer's input and the per-layer scores. A single-layer
experiment at layer L starts from the cached input of L (layers below it are unchanged) and runs layers L..29. In a
multi-layer set the stream changes after the first routed layer, so each later routed layer scores its tokens on
the stream it actually receives (a dense block pass for the score, then the routed pass), as teacher evaluation
does.

Held-out data (said in the output): the chats are built as the recipe's evaluation builds its perplexity set
(`chatapp.recipes.smollm2.evaluate.held_out_chat`): half general, half held-out tool conversations
(`data.tool_questions(..., held_out=True)`: held-out phrasings and operands, with the calculator call and result).
The general half is the recipe's held-out split of self-distilled answers (`held_out_general.json` in its working
directory, `--work`) when that directory exists, else held-out general questions (`data.FACT_QUESTIONS`, never
training prompts) answered by the model's own greedy decode with routing off (the prepared default model ships
without the split). Perplexity counts the supervised (assistant) tokens of the chat format's loss mask.

Copy probe: held-out arithmetic, word-problem and percent questions rendered with their calculator call
(`<jupyter_code>37*45<jupyter_output>` for the default model; the chat format's tool markers), cut after the call,
teacher-forced; a probe is right when the greedy prediction of every digit token inside the call is the operand
digit that follows. Reported as the share of probes right.

Multi-layer sets (`--sets`, default "8@0.5,12@0.3"): the N layers with the lowest single-layer perplexity
ratio at that fraction (at the nearest measured fraction when that one was not swept), per skip mode, by the
first score of `--scores`; plus the model's own STT layers at 50%. Compute saved is `chatapp.compute_saved`: the
share of ALL the model's block computations (tokens x all decoder layers) skipped.

Run: PYTHONPATH=. .venv/bin/python benchmarks/stt_oracle.py [--model DIR] [--layers 0-29] [--fractions 0.3,0.5,0.7]
     [--scores dx,g,tpn] [--modes strict,kv] [--chats 12] [--max-tokens 256] [--probes 24]
     [--other-fractions 0.5] [--more-fractions 0.3,0.7 --more-layers 1,2,28,29] [--sets 8@0.5,12@0.3]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from _machine import machine

from chatapp.compute_saved import compute_saved, skip_cost
from chatapp.stt import STTConfig, STTForCausalLM
from chatapp.stt.config import betas_at
from chatapp.stt.layers import STTLayer, rms_norm, self_attention_sink
from chatapp.stt.teacher import previous_tokens
from chatapp.training.route import selected_by_score

SCORES = ("dx", "tpn", "g", "dxf", "random")
MODES = ("strict", "kv", "predict")
HELD_OUT_SEED = 1234  # chatapp.recipes.smollm2.evaluate's
PROBE_KINDS = ("arithmetic", "word problem", "percent")


# ----------------------------------------------------------------------------------------------------------- data
@dataclass
class Batch:
    """Right-padded sequences and the positions whose next token is read: `read[b, t]` means "score the prediction
    of ids[b, t + 1] made at t" (shape (B, T - 1))."""

    ids: torch.Tensor  # (B, T)
    valid: torch.Tensor  # (B, T) bool
    read: torch.Tensor  # (B, T - 1) bool


def batched(rows: list[list[int]], reads: list[list[bool]], pad: int, budget: int = 1024) -> list[Batch]:
    """Sequences sorted by length in right-padded batches of at most `budget` positions (little padding)."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    groups: list[list[int]] = [[]]
    for i in order:
        if groups[-1] and len(rows[i]) * (len(groups[-1]) + 1) > budget:
            groups.append([])
        groups[-1].append(i)
    return [padded([rows[i] for i in g], [reads[i] for i in g], pad) for g in groups]


def padded(rows: list[list[int]], reads: list[list[bool]], pad: int) -> Batch:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    read = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for b, (row, r) in enumerate(zip(rows, reads, strict=True)):
        ids[b, : len(row)] = torch.tensor(row)
        valid[b, : len(row)] = True
        read[b, : len(r)] = torch.tensor(r, dtype=torch.bool)
    return Batch(ids, valid, read)


@torch.no_grad()
def greedy_answer(model: STTForCausalLM, chat_format, question: str, max_new: int) -> str:
    """The model's own answer, greedy with routing off, through its cache (`extend` / `decode`)."""
    prompt = chat_format.render_for_completion([{"role": "user", "content": question}])
    cache = model.new_cache(1, len(prompt) + max_new + 1)
    ids = torch.tensor([prompt])
    out = model.extend(ids, torch.tensor([len(prompt)]), cache, routing="off")
    stops = set(chat_format.stop_token_ids)
    answer: list[int] = []
    for _ in range(max_new):
        token = int(out.logits[0].argmax())
        if token in stops:
            break
        answer.append(token)
        out = model.decode(torch.tensor([token]), cache, routing="off")
    return chat_format.decode(answer).strip()


def held_out_chats(
    model: STTForCausalLM, chat_format, count: int, max_tokens: int, answer_tokens: int, work: Path
) -> tuple[list[Batch], str]:
    """The chats in batches, and where their general half came from."""
    from chatapp.recipes.smollm2 import data
    from chatapp.recipes.smollm2.train import held_out_general

    half = (count + 1) // 2
    if pairs := held_out_general(work)[:half]:
        source = f"{len(pairs)} held-out self-distilled answers from {work}"
    else:
        questions = random.Random(HELD_OUT_SEED).sample(list(data.FACT_QUESTIONS), half)
        pairs = [(q.question, greedy_answer(model, chat_format, q.question, answer_tokens)) for q in questions]
        source = (
            f"{half} general questions from data.FACT_QUESTIONS answered by the model's greedy decode, routing off, "
            f"<= {answer_tokens} tokens"
        )
    conversations = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}] for q, a in pairs]
    tools = data.tool_questions(random.Random(HELD_OUT_SEED + 3), count // 2, held_out=True)
    conversations += [data.tool_conversation(q, a) for q, a in tools]
    rows, reads = [], []
    for messages in conversations:
        ids, mask = chat_format.render_conversation(messages, max_tokens=max_tokens)
        rows.append(ids)
        reads.append([bool(m) for m in mask[1:]])
    return batched(rows, reads, pad=rows[0][0]), source


def copy_probes(chat_format, count: int) -> list[Batch]:
    """Prompt + call through its closing marker; read the digit tokens inside the call."""
    from chatapp.recipes.smollm2 import data

    start, end = chat_format.python_start_id, chat_format.python_end_id
    if start is None or end is None:
        raise SystemExit("this model's chat format has no tool markers: no copy probe")
    rows, reads = [], []
    items = data.tool_questions(random.Random(HELD_OUT_SEED + 5), count, held_out=True, kinds=PROBE_KINDS)
    for q, a in items:
        ids, _ = chat_format.render_conversation(data.tool_conversation(q, a))
        p = ids.index(start)
        e = ids.index(end, p)
        ids = ids[: e + 1]
        read = [False] * (len(ids) - 1)
        for t in range(p, e - 1):  # prediction at t of token t + 1, inside the call
            if any(c.isdigit() for c in chat_format.decode([ids[t + 1]])):
                read[t] = True
        rows.append(ids)
        reads.append(read)
    return batched(rows, reads, pad=rows[0][0])


# ------------------------------------------------------------------------------------------------- the forwards
@dataclass
class Dense:
    """One dense pass: every layer's input (index L) and the final hidden state (index N), the rotary tables, and
    per-layer scores computed from the dense stream."""

    inputs: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    scores: dict[str, dict[int, torch.Tensor]]


def layer_scores(
    model: STTForCausalLM, index: int, x: torch.Tensor, y: torch.Tensor, names, predictors=None
) -> dict[str, torch.Tensor]:
    """Per-token scores (B, T) of layer `index` from its input `x` and dense output `y` (higher = keep);
    `predictors`: rank -> layer -> SkipPredictor, for the `dxf@RANK` scores."""
    layer = model.model.layers[index]
    residual = y - x
    out = {}
    if "dx" in names:
        out["dx"] = residual.float().pow(2).mean(-1)
    for rank, by_layer in (predictors or {}).items():
        if f"dxf@{rank}" in names and index in by_layer:
            predicted = by_layer[index](rms_norm(layer.input_layernorm, x))
            out[f"dxf@{rank}"] = (residual - predicted).float().pow(2).mean(-1)
    if isinstance(layer, STTLayer) and ({"tpn", "g"} & set(names)):
        predicted = layer.transition_network(previous_tokens(y))
        d_st, d_ch = layer.predictive_router.surprises(residual, predicted)
        out["tpn"] = d_ch
        out["g"] = layer.predictive_router.gate(d_st, d_ch, *betas_at(model.config, None))
    if "random" in names:
        gen = torch.Generator().manual_seed(1000 + index)
        out["random"] = torch.rand(x.shape[:2], generator=gen)
    return {k: v for k, v in out.items() if k in names}


@torch.no_grad()
def dense_pass(model: STTForCausalLM, batch: Batch, names, predictors=None) -> Dense:
    hidden = model.model.embed_tokens(batch.ids)
    positions = torch.arange(batch.ids.shape[1])[None, :].expand_as(batch.ids)
    cos, sin = model.model.rotary_emb(hidden, positions)
    causal = self_attention_sink()
    inputs, scores = [], {name: {} for name in names}
    for index, layer in enumerate(model.model.layers):
        inputs.append(hidden)
        y = layer.block(hidden, cos, sin, causal)
        for name, s in layer_scores(model, index, hidden, y, names, predictors).items():
            scores[name][index] = s
        hidden = y
    inputs.append(hidden)
    return Dense(inputs, cos, sin, scores)


@torch.no_grad()
def routed_run(
    model: STTForCausalLM, batch: Batch, dense: Dense, plan: dict[int, float], score: str, mode: str, predictors=None
) -> tuple[torch.Tensor, int]:
    """The final hidden state with the layers of `plan` routed (layer -> skipped fraction), and the number of
    (token, layer) block computations skipped. `mode` "predict@RANK": "predict" with that rank's predictors."""
    mode, _, rank = mode.partition("@")
    by_layer = (predictors or {}).get(int(rank), {}) if rank else {}
    start = min(plan)
    hidden = dense.inputs[start]
    causal = self_attention_sink()
    skipped = 0
    for index in range(start, len(model.model.layers)):
        layer = model.model.layers[index]
        if index not in plan:
            hidden = layer.block(hidden, dense.cos, dense.sin, causal)
            continue
        if index == start:
            s = dense.scores[score][index]
        else:  # the stream changed below: score on what this layer actually receives
            y = layer.block(hidden, dense.cos, dense.sin, causal)
            s = layer_scores(model, index, hidden, y, (score,), predictors)[score]
        selected = selected_by_score(s, batch.valid, plan[index])
        skipped += int((~selected & batch.valid).sum())
        hidden = layer.routed(hidden, dense.cos, dense.sin, selected, mode, by_layer.get(index))
    return hidden, skipped


def read_logits(model: STTForCausalLM, hidden: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at the read positions (the LM head runs on those only) and their targets."""
    picked = hidden[:, :-1][batch.read]
    return model.lm_head(model.model.norm(picked)).float(), batch.ids[:, 1:][batch.read]


def nll_sum(model: STTForCausalLM, hidden: torch.Tensor, batch: Batch) -> float:
    logits, targets = read_logits(model, hidden, batch)
    return F.cross_entropy(logits, targets, reduction="sum").item()


def copies_right(model: STTForCausalLM, hidden: torch.Tensor, batch: Batch) -> int:
    """Probes (rows) whose every read digit is predicted right."""
    logits, targets = read_logits(model, hidden, batch)
    rows = batch.read.nonzero()[:, 0]
    wrong = rows[logits.argmax(-1) != targets].unique()
    return batch.ids.shape[0] - len(wrong)


# ------------------------------------------------------------------------------------------------------ the sweep
@dataclass
class Result:
    ppl_ratio: float
    copy: float
    saved: float  # share of all block computations skipped


class Oracle:
    """The held-out chats and the probes with their dense passes cached; `run` routes a plan over all of them."""

    def __init__(
        self, model: STTForCausalLM, chats: list[Batch], probes: list[Batch], names, predictors=None
    ) -> None:
        self.model, self.predictors = model, predictors or {}
        self.chats = [(b, dense_pass(model, b, names, predictors)) for b in chats]
        self.probes = [(b, dense_pass(model, b, names, predictors)) for b in probes]
        self.tokens = sum(int(b.valid.sum()) for b in chats)
        self.scored = sum(int(b.read.sum()) for b in chats)
        self.probe_count = sum(b.ids.shape[0] for b in probes)
        self.dense_nll = sum(nll_sum(model, d.inputs[-1], b) for b, d in self.chats) / self.scored
        self.dense_copy = sum(copies_right(model, d.inputs[-1], b) for b, d in self.probes) / self.probe_count

    @property
    def dense_ppl(self) -> float:
        return math.exp(self.dense_nll)

    def has(self, layer: int, score: str) -> bool:
        return layer in self.chats[0][1].scores[score]

    def run(self, plan: dict[int, float], score: str, mode: str) -> Result:
        nll, skipped, right = 0.0, 0, 0
        for batch, dense in self.chats:
            hidden, n = routed_run(self.model, batch, dense, plan, score, mode, self.predictors)
            nll += nll_sum(self.model, hidden, batch)
            skipped += n
        for batch, dense in self.probes:
            hidden, _ = routed_run(self.model, batch, dense, plan, score, mode, self.predictors)
            right += copies_right(self.model, hidden, batch)
        # Net of what a skipped token still computes in the mode (`chatapp.compute_saved.skip_cost`).
        base, _, rank = mode.partition("@")
        shape = {"skip_mode": base, "predictor_rank": int(rank) if rank else 0}
        cost = skip_cost(STTConfig.from_dict({**self.model.config.to_dict(), **shape}))
        saved = compute_saved(skipped, self.tokens, self.model.config.num_hidden_layers, cost)
        return Result(math.exp(nll / self.scored - self.dense_nll), right / self.probe_count, saved)


def fit_skip_predictors(model: STTForCausalLM, path: Path, layers: list[int], ranks: list[int]) -> dict:
    """rank -> layer -> SkipPredictor fitted on the replies in `path` (every 4th held out for the ridge strength)."""
    import json

    from chatapp.stt.layers import SkipPredictor
    from chatapp.training.predictor import layer_statistics, solve

    rows = [r["ids"] for r in json.loads(path.read_text(encoding="utf-8"))]
    batches = batched(rows, [[False] * (len(r) - 1) for r in rows], pad=rows[0][0])
    passes = ((dense_pass(model, b, ()).inputs, b.valid, i % 4 == 3) for i, b in enumerate(batches))
    fit, held = layer_statistics(model, passes, layers)
    log(f"predictors: {sum(len(r) for r in rows)} tokens of {len(rows)} replies from {path}")
    out: dict[int, dict[int, SkipPredictor]] = {}
    for rank in ranks:
        config = STTConfig.from_dict({**model.config.to_dict(), "skip_mode": "predict", "predictor_rank": rank})
        out[rank] = {}
        for layer in layers:
            found = solve(fit[layer], held[layer], rank)
            out[rank][layer] = predictor = SkipPredictor(config).eval()
            found.load_into(predictor)
            log(f"rank {rank} layer {layer}: explains {found.explained:.1%} of held-out E|dx|^2")
    return out


def parse_layers(text: str, count: int) -> list[int]:
    if text == "all":
        return list(range(count))
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    bad = [i for i in out if not 0 <= i < count]
    if bad:
        raise SystemExit(f"--layers: {bad} outside 0..{count - 1}")
    return sorted(set(out))


def parse_sets(text: str) -> list[tuple[int, float]]:
    out = []
    for part in filter(None, text.split(",")):
        n, _, f = part.partition("@")
        out.append((int(n), float(f)))
    return out


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="a registered model name or a model directory")
    parser.add_argument("--layers", default="all", help="single-layer sweep: 'all' or e.g. 0-5,9,17")
    parser.add_argument("--fractions", default="0.3,0.5,0.7", help="skipped shares of each sequence's tokens")
    parser.add_argument("--other-fractions", default="0.5", help="fractions for the scores after the first")
    parser.add_argument("--more-fractions", default="", help="fractions swept for the first score on --more-layers")
    parser.add_argument("--more-layers", default="", help="the layers of --more-fractions, e.g. 0-3,9,17,25,28,29")
    parser.add_argument(
        "--scores", default="dx", help=f"token scores, of {','.join(SCORES)}; the first ranks the sets"
    )
    parser.add_argument("--modes", default="strict,kv", help="skip modes: strict, kv, predict")
    parser.add_argument("--ranks", default="64", help="predict mode: the predictors' ranks, each a mode of its own")
    parser.add_argument("--fit-replies", default=None, help="predict mode: the replies f is fitted on (route's JSON)")
    parser.add_argument("--chats", type=int, default=24, help="held-out chats (half general, half tool)")
    parser.add_argument("--max-tokens", type=int, default=256, help="each chat cut to this many tokens")
    parser.add_argument("--work", default="runs/smollm2", help="the recipe's working directory (held-out split)")
    parser.add_argument("--answer-tokens", type=int, default=64, help="greedy answer length for the general chats")
    parser.add_argument("--probes", type=int, default=24, help="copy-probe questions")
    parser.add_argument("--sets", default="8@0.5,12@0.3", help="multi-layer sets N@FRACTION, '' for none")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the loader's)")
    args = parser.parse_args(argv)
    scores = [s for s in args.scores.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    fractions = [float(f) for f in args.fractions.split(",") if f]
    other_fractions = [float(f) for f in args.other_fractions.split(",") if f]
    more_fractions = [float(f) for f in args.more_fractions.split(",") if f]
    if bad := [s for s in scores if s not in SCORES] + [m for m in modes if m not in MODES]:
        raise SystemExit(f"unknown score or mode: {bad}")
    ranks = [int(r) for r in args.ranks.split(",") if r] if "predict" in modes else []
    if ranks and not args.fit_replies:
        raise SystemExit("predict mode needs --fit-replies (the JSON of replies `chatapp route` keeps)")
    # Each rank is a mode; its score is dxf at that rank where the others use dx (the best-predicted tokens skip).
    modes = [m for m in modes if m != "predict"] + [f"predict@{r}" for r in ranks]
    scores = [s for s in scores if s != "dxf"] + [f"dxf@{r}" for r in ranks]

    from chatapp.models.loader import load_model

    began = time.perf_counter()
    loaded = load_model(args.model, device="cpu", dtype="float32", compile=False)
    model = STTForCausalLM.from_pretrained(Path(loaded.path), dtype=torch.float32).eval()
    del loaded.model
    if args.threads:
        torch.set_num_threads(args.threads)
    n_layers = model.config.num_hidden_layers
    layers = parse_layers(args.layers, n_layers)
    more_layers = parse_layers(args.more_layers, n_layers) if args.more_layers else []
    sweeps = [(scores[0], f, layers) for f in fractions]
    sweeps += [(s, f, layers) for s in scores[1:] if not s.startswith("dxf@") for f in other_fractions]
    sweeps += [(f"dxf@{r}", f, layers) for r in ranks for f in fractions]
    sweeps += [(scores[0], f, more_layers) for f in more_fractions if f not in fractions]
    chats, source = held_out_chats(
        model, loaded.chat_format, args.chats, args.max_tokens, args.answer_tokens, Path(args.work)
    )
    probes = copy_probes(loaded.chat_format, args.probes)
    fitted = sorted(set(layers) | set(more_layers) | set(model.config.stt_layers))  # every layer a plan may route
    predictors = fit_skip_predictors(model, Path(args.fit_replies), fitted, ranks) if ranks else {}
    oracle = Oracle(model, chats, probes, scores, predictors)
    log(f"data and dense passes: {time.perf_counter() - began:.0f} s")

    # Sanity: the routed path with nothing skipped is the dense model.
    check = oracle.run({layers[0]: 0.0}, scores[0], modes[0])
    if abs(check.ppl_ratio - 1) > 1e-4 or check.copy != oracle.dense_copy:
        raise SystemExit(f"routed pass with nothing skipped differs from dense: {check}")

    results: dict[tuple[str, str, float, int], Result] = {}
    for mode in modes:
        for score, fraction, sweep_layers in sweeps:
            if score.startswith("dxf@") != mode.startswith("predict@") or (
                score.startswith("dxf@") and score[4:] != mode[8:]
            ):
                continue  # each predict mode with its own rank's score, the other modes with the others
            for layer in sweep_layers:
                if not oracle.has(layer, score):
                    continue
                t = time.perf_counter()
                results[mode, score, fraction, layer] = r = oracle.run({layer: fraction}, score, mode)
                log(
                    f"{mode} {score} {fraction:.0%} layer {layer}: ppl x{r.ppl_ratio:.4f} copy {r.copy:.2f} "
                    f"({time.perf_counter() - t:.1f} s)"
                )

    print(f"# STT oracle: {loaded.path}")
    print(f"machine: {machine()}")
    print(
        f"held-out chats: {args.chats} ({source}; {args.chats // 2} held-out tool conversations), "
        f"cut to {args.max_tokens} tokens: {oracle.tokens} tokens, {oracle.scored} scored; dense perplexity "
        f"{oracle.dense_ppl:.3f}"
    )
    print(f"copy probe: {args.probes} held-out {'/'.join(PROBE_KINDS)} calls, dense accuracy {oracle.dense_copy:.2f}")
    print(f"model's STT layers: {list(model.config.stt_layers)} (g and tpn exist only there)")
    print("cells: perplexity / dense, then copy-probe accuracy; skipped = lowest-score tokens, first token kept\n")
    columns = list(dict.fromkeys((s, f) for s, f, _ in sweeps))
    for mode in modes:
        print(f"## skip mode {mode!r}: one layer routed\n")
        head = " | ".join(f"{s} {f:.0%} ppl× | copy" for s, f in columns)
        print(f"| layer | {head} |")
        print("|---:|" + "---:|---:|" * len(columns))
        for layer in sorted(set(layers) | set(more_layers)):
            cells = []
            for s, f in columns:
                r = results.get((mode, s, f, layer))
                cells += [f"{r.ppl_ratio:.3f}", f"{r.copy:.2f}"] if r else ["", ""]
            print(f"| {layer}{'*' if layer in model.config.stt_layers else ''} | " + " | ".join(cells) + " |")
        print()

    sets = parse_sets(args.sets)
    if not sets and not model.config.stt_layers:
        return
    print(f"## multi-layer sets (score {scores[0]}, dxf in predict modes; ranked by the single-layer ppl ratio in "
          "the same mode)\n")
    print("| mode | set | layers | ppl× | copy | compute saved (all blocks) |")
    print("|---|---|---|---:|---:|---:|")
    for mode in modes:
        score = f"dxf@{mode[8:]}" if mode.startswith("predict@") else scores[0]
        plans = []
        for n, f in sets:
            # Rank at the fraction nearest f among those swept over the most layers (a fraction swept over a
            # subset would rank only that subset).
            swept: dict[float, int] = {}
            for k in results:
                if k[:2] == (mode, score):
                    swept[k[2]] = swept.get(k[2], 0) + 1
            if not swept:
                continue
            widest = max(swept.values())
            rank_at = min((x for x, c in swept.items() if c == widest), key=lambda x: abs(x - f))
            ranked = sorted(
                (k[3] for k in results if k[:3] == (mode, score, rank_at)),
                key=lambda layer: results[mode, score, rank_at, layer].ppl_ratio,
            )
            label = f"best {n} at {f:.0%}" + ("" if rank_at == f else f" (ranked at {rank_at:.0%})")
            plans.append((label, sorted(ranked[:n]), f, score))
        stt = list(model.config.stt_layers)
        if stt:
            plans.append(("model's STT layers at 50%", stt, 0.5, score))
        for label, chosen, f, s in plans:
            t = time.perf_counter()
            r = oracle.run(dict.fromkeys(chosen, f), s, mode)
            log(f"{mode} {label}: {time.perf_counter() - t:.1f} s")
            print(
                f"| {mode} | {label} | {','.join(map(str, chosen))} | {r.ppl_ratio:.3f} | {r.copy:.2f} | {r.saved:.1%} |"
            )
    print(f"\n{time.perf_counter() - began:.0f} s in all")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
