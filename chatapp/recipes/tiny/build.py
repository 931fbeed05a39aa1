"""Build the shipped tiny model: corpus → tokenizer → STT model → training → evaluation → `models/tiny/`.

Run by `make train-tiny` (`python -m chatapp.recipes.tiny.build`). Everything is seeded and runs on the CPU,
so the same command rebuilds the same model; nothing is downloaded. The result is a Hugging Face-style directory
(`config.json`, `model.safetensors`, `tokenizer.json`) plus `MODEL_CARD.md` with the recipe and the held-out
metrics, written next to the package code so it ships inside the wheel.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from chatapp import store
from chatapp.models.registry import tiny_model_dir
from chatapp.models.route_prompts import ROUTE_PROMPTS_FILE
from chatapp.recipes.tiny.corpus import THINK_CLOSE, THINK_OPEN, Conversation, conversation_text, generate_corpus
from chatapp.recipes.tiny.tokenizer import CHAT_SPECIAL_TOKENS, train_bpe_tokenizer
from chatapp.training.corpus import write_dialogues

SPECIAL_TOKENS: tuple[str, ...] = (*CHAT_SPECIAL_TOKENS, THINK_OPEN, THINK_CLOSE)
# The first line of MODEL_CARD.md: how a model directory says the tiny recipe made it (`recipes.heldout.recipe_of`).
CARD_TITLE = "# chatapp tiny model"
# Conversations of the prompt set the model ships for `chatapp route` (`chatapp.models.route_prompts`): a route
# draws 96 of them by default, up to all.
ROUTE_PROMPTS = 512


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the tiny model. Changing a field changes the model."""

    seed: int = 0
    train_conversations: int = 200_000
    heldout_conversations: int = 600
    vocab_size: int = 2048
    # Characters the tokenizer never merges (see `train_bpe_tokenizer`): `"` makes quoted words copyable.
    isolated_chars: str = ""
    # Quoted lowercase words are spelled one token per letter (`train_bpe_tokenizer`): letter counting copies them.
    spell_quoted_words: bool = True
    # Shape: blocks hold most parameters (the vocabulary of this corpus is under 2k tokens); STT layers alternate
    # with dense ones, starting at layer 1, as in the STT paper.
    hidden_size: int = 192
    num_layers: int = 6
    intermediate_size: int = 576
    num_heads: int = 3
    num_kv_heads: int = 3
    context: int = 256
    # Training: conversations laid end to end and cut into windows (chatapp.training.loop), AdamW with linear warmup
    # then cosine decay to `min_lr_ratio` of the peak. `lr` is the base model's peak learning rate.
    steps: int = 3600
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 200
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    # STT routing: capacity (the student's initial rate, the gate regulariser's target) and the optional second
    # phase of `gated_steps` steps with the spec's gated second pass on selected tokens (see STTConfig).
    capacity: float = 0.6
    gated_steps: int = 800
    gated_lr_ratio: float = 0.3
    # The student's decision threshold is set after training to the one that reproduces the teacher best on whole
    # training conversations (`training.calibrate`). The causal router's probabilities run low, so at 0.5
    # the student selects well under the teacher's fraction, and a skipped token is one later tokens cannot copy
    # from. Matching the teacher's fraction on training windows instead picks a higher threshold with lower
    # held-out F1 and calculator accuracy (the model card has the numbers). False keeps 0.5.
    calibrate_threshold: bool = True
    # On-disk precision of the weights (they load as float32 on the CPU).
    store_dtype: str = "float16"
    # CPU threads for training, fixed rather than "all cores": float reductions split by thread count, so a fixed
    # count keeps the weights independent of the machine. Two is the target machine (2 cores): 0.41 s per dense
    # step against 0.67 s with one on a quiet box.
    threads: int = 2
    extra_config: dict[str, Any] = field(default_factory=dict)

    def quick(self) -> Recipe:
        """A seconds-long recipe with the same code path (for smoke tests of the pipeline, not for shipping)."""
        return replace(
            self,
            train_conversations=300,
            heldout_conversations=12,
            vocab_size=512,
            hidden_size=64,
            num_layers=2,
            intermediate_size=128,
            num_heads=2,
            num_kv_heads=1,
            steps=4,
            gated_steps=2 if self.gated_steps else 0,
            batch_size=4,
            seq_len=64,
            warmup_steps=1,
        )


def build_tokenizer(corpus: list[Conversation], recipe: Recipe):
    """Byte-level BPE over the training split, digits split individually, chat + think tokens first."""
    return train_bpe_tokenizer(
        (conversation_text(c) for c in corpus),
        recipe.vocab_size,
        SPECIAL_TOKENS,
        individual_digits=True,
        isolated=recipe.isolated_chars,
        spell_quoted_words=recipe.spell_quoted_words,
    )


def letter_pieces(tokenizer) -> list[str]:
    """The tokenizer's lowercase letter-only tokens (no leading space): what unseen words inside quotes split into."""
    return sorted(t for t in tokenizer.get_vocab() if t.isascii() and t.isalpha() and t.islower())


def build_corpus(recipe: Recipe):
    """The training split, its tokenizer and the held-out split.

    Two passes: the tokenizer is trained on a first corpus, then the training split is drawn again with the
    tokenizer's letter pieces as building blocks for invented letter-counting words (see
    `corpus._Generator._invented_word`). The tokenizer does not change: the pieces are its own tokens.
    """
    draft = generate_corpus(recipe.train_conversations, "train", recipe.seed)
    tokenizer = build_tokenizer(draft, recipe)
    corpus = generate_corpus(recipe.train_conversations, "train", recipe.seed, word_pieces=letter_pieces(tokenizer))
    heldout = generate_corpus(recipe.heldout_conversations, "heldout", recipe.seed)
    return corpus, tokenizer, heldout


def route_prompt_set(recipe: Recipe) -> list[list[str]]:
    """The user turns of the first `ROUTE_PROMPTS` conversations of the training split (the held-out split stays
    unseen for the evaluation): what `chatapp route tiny` has the model answer."""
    conversations = generate_corpus(ROUTE_PROMPTS, "train", recipe.seed)
    return [[m["content"] for m in c.messages if m["role"] == "user"] for c in conversations]


def build_config(recipe: Recipe, vocab_size: int):
    """The STT configuration for `recipe`: a Qwen2 shape with every other layer an STT layer."""
    from chatapp.stt import STTConfig

    return STTConfig(
        vocab_size=vocab_size,
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=recipe.context,
        tie_word_embeddings=True,
        capacity=recipe.capacity,
        g_reg_target=recipe.capacity,
        lr_base=recipe.lr,
        **recipe.extra_config,
    )


@dataclass
class Metrics:
    """Held-out metrics of a built model (what the model card reports)."""

    tasks: dict[str, dict[str, float | int]]
    perplexity: dict[str, float]
    selected_fraction: dict[str, list[float]]
    student_f1: list[float]
    student_accuracy: list[float]
    failures: list[tuple[str, str]]

    @property
    def student_over_off(self) -> float:
        return self.perplexity["student"] / self.perplexity["off"]


def evaluate_model_dir(model_dir: Path, heldout: list[Conversation], log=print) -> Metrics:
    """Load `model_dir` as users will (float32 on the CPU) and measure it on the held-out split."""
    from chatapp.models import load_engine
    from chatapp.recipes.tiny.evaluate import evaluate_tasks, routing_batches
    from chatapp.settings import GenerationSettings
    from chatapp.training.evaluation import evaluate

    engine = load_engine(model_dir, device="cpu")
    started = time.perf_counter()
    tasks = evaluate_tasks(engine, heldout, GenerationSettings(max_tokens=96, routing="student"))
    log(f"task metrics in {time.perf_counter() - started:.0f}s")
    for label, tally in tasks.rows():
        log(f"  {label}: {tally}")
    report = evaluate(engine.model, routing_batches(heldout, engine.chat_format))
    return Metrics(
        tasks=tasks.as_dict(),
        perplexity=report.perplexity,
        selected_fraction=report.selected_fraction,
        student_f1=report.student_f1,
        student_accuracy=report.student_accuracy,
        failures=tasks.failures,
    )


def _progress(log, every: int, started: float):
    """An `on_step` callback for `chatapp.training.loop.train` that logs losses and routing every `every` steps."""

    def on_step(report) -> None:
        if report.step % every and report.step != report.steps:
            return
        losses = " ".join(f"{k}={v:.4f}" for k, v in report.losses.items())
        fractions = " ".join(f"{f:.2f}" for f in report.teacher_fraction)
        f1 = " ".join(f"{f:.2f}" for f in report.student_f1)
        log(
            f"step {report.step}/{report.steps} {losses} | teacher fraction {fractions} | student F1 {f1} | "
            f"{report.tokens_per_s:.0f} tok/s | {time.perf_counter() - started:.0f}s"
        )

    return on_step


def train_model(recipe: Recipe, corpus: list[Conversation], chat_format, log=print):
    """Initialise the STT model with the recipe's seed and train it: the dense phase, then the gated one if any;
    returns the model and the seconds training took."""
    import torch

    from chatapp.stt import STTForCausalLM
    from chatapp.training.loop import TokenStream, TrainConfig, train

    torch.manual_seed(recipe.seed)
    model = STTForCausalLM(build_config(recipe, chat_format.tokenizer.get_vocab_size()))
    data = TokenStream.from_sequences(chat_format.render_conversation(c.messages) for c in corpus)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; corpus: {len(data)} tokens")
    started = time.perf_counter()
    common = {
        "batch_size": recipe.batch_size,
        "seq_len": recipe.seq_len,
        "min_lr_ratio": recipe.min_lr_ratio,
        "weight_decay": recipe.weight_decay,
        "seed": recipe.seed,
    }
    every = max(1, recipe.steps // 40)
    train(
        model,
        data,
        TrainConfig(steps=recipe.steps, warmup_steps=recipe.warmup_steps, **common),
        on_step=_progress(log, every, started),
    )
    if recipe.gated_steps:
        # Phase 2: selected tokens are recomputed attending only to selected keys, as at inference, so the base
        # model learns to work with the routing it will get. The gate is hard from the start (end betas).
        model.config.gated_second_pass = True
        model.config.beta_schedule = "constant"
        # The teacher's biases stay as the dense phase left them (near the capacity target): through the
        # straight-through gate the LM loss would otherwise pull them towards routing fewer and fewer tokens.
        for layer in model.model.layers:
            if (router := getattr(layer, "predictive_router", None)) is not None:
                router.requires_grad_(False)
        log("gated phase: second pass on selected tokens")
        train(
            model,
            data,
            TrainConfig(
                steps=recipe.gated_steps,
                warmup_steps=max(1, recipe.warmup_steps // 4),
                lr_scale=recipe.gated_lr_ratio,
                **{**common, "seed": recipe.seed + 1},
            ),
            on_step=_progress(log, max(1, recipe.gated_steps // 20), started),
        )
    model.config.routing_trained = True
    return model, time.perf_counter() - started


def calibrate_model_dir(directory: Path, conversations: list[Conversation], log=print) -> float:
    """Calibrate the saved model as users load it (stored precision, float32 on the CPU) on `conversations` (a
    sample of the training split) and write the threshold into its config.json."""
    import json

    from chatapp.models import load_model
    from chatapp.recipes.tiny.evaluate import routing_batches
    from chatapp.training.calibrate import calibrate_router_threshold

    loaded = load_model(directory, device="cpu")
    calibration = calibrate_router_threshold(loaded.model, routing_batches(conversations, loaded.chat_format))
    path = directory / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["router_threshold"] = calibration.threshold
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    log(
        f"router threshold {calibration.threshold:.2f}: student-teacher F1 {calibration.f1:.3f}, "
        f"{calibration.processed:.1%} processed on {len(conversations)} training conversations"
    )
    return calibration.threshold


def save_model_dir(model, tokenizer, directory: Path, store_dtype: str) -> None:
    """Write the weights (in `store_dtype`), config.json and tokenizer.json into `directory`."""
    import torch

    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[store_dtype]
    original = model.dtype
    model.to(dtype).save_pretrained(directory)
    model.to(original)
    tokenizer.save(str(directory / "tokenizer.json"))


def _make_readable(directory: Path) -> None:
    """Temporary files and directories are created private (0600/0700); shipped model files are plain 0644/0755."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def build(recipe: Recipe, out_dir: Path, log=print) -> Metrics:
    """The whole pipeline; `out_dir` is replaced only once the new model is written and evaluated."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(recipe.threads)
    try:
        return _build(recipe, out_dir, log)
    finally:
        torch.set_num_threads(previous)


def _build(recipe: Recipe, out_dir: Path, log) -> Metrics:
    from chatapp.chat import ChatFormat

    started = time.perf_counter()
    corpus, tokenizer, heldout = build_corpus(recipe)
    chat_format = ChatFormat(tokenizer)
    log(f"corpus: {len(corpus)} train / {len(heldout)} held-out conversations; vocab {tokenizer.get_vocab_size()}")
    model, train_seconds = train_model(recipe, corpus, chat_format, log)
    # Through the store (staged beside `out_dir`, renamed into place); no completeness stamp: the shipped
    # directory's files are exactly the model's.
    with store.staged_dir(out_dir, stamp=False, what="tiny model directory") as staging:
        save_model_dir(model, tokenizer, staging, recipe.store_dtype)
        if recipe.calibrate_threshold:
            calibrate_model_dir(staging, corpus[: recipe.heldout_conversations], log)
        metrics = evaluate_model_dir(staging, heldout, log)
        card = model_card(recipe, metrics, train_seconds, time.perf_counter() - started, tokenizer.get_vocab_size())
        (staging / "MODEL_CARD.md").write_text(card, encoding="utf-8")
        write_dialogues(staging / ROUTE_PROMPTS_FILE, route_prompt_set(recipe))
        _make_readable(staging)
    log(f"wrote {out_dir} in {time.perf_counter() - started:.0f}s")
    return metrics


@dataclass(frozen=True)
class Target:
    """One acceptance target of the tiny model, checked against measured metrics."""

    name: str
    goal: str
    value: str
    met: bool


def targets(metrics: Metrics) -> list[Target]:
    """The tiny model's acceptance targets (held-out split, student routing, greedy)."""
    tasks = metrics.tasks
    student = metrics.selected_fraction.get("student", [])
    mean_fraction = sum(student) / len(student) if student else float("nan")
    mean_f1 = sum(metrics.student_f1) / len(metrics.student_f1) if metrics.student_f1 else float("nan")
    return [
        Target(
            "calculator accuracy", ">= 95%", f"{tasks['calculator']['rate']:.1%}", tasks["calculator"]["rate"] >= 0.95
        ),
        Target("letter-count accuracy", ">= 95%", f"{tasks['letters']['rate']:.1%}", tasks["letters"]["rate"] >= 0.95),
        Target("JSON parses", ">= 99%", f"{tasks['json_valid']['rate']:.1%}", tasks["json_valid"]["rate"] >= 0.99),
        Target(
            "student / off perplexity",
            "<= 1.10",
            f"{metrics.student_over_off:.3f}",
            metrics.student_over_off <= 1.10,
        ),
        Target("mean tokens processed (STT layers)", "30-70%", f"{mean_fraction:.1%}", 0.3 <= mean_fraction <= 0.7),
        Target(
            "every STT layer processes",
            "10-90%",
            ", ".join(f"{f:.0%}" for f in student),
            bool(student) and all(0.1 <= f <= 0.9 for f in student),
        ),
        Target("student-teacher F1 (mean over layers)", ">= 0.8", f"{mean_f1:.3f}", mean_f1 >= 0.8),
    ]


def model_card(recipe: Recipe, metrics: Metrics, train_seconds: float, total_seconds: float, vocab: int) -> str:
    """MODEL_CARD.md: what the model is, how it was made, how well it does, how to rebuild it."""
    from chatapp.training.calibrate import F1_TOLERANCE, MAX_PROCESSED

    recipe_rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in asdict(recipe).items())
    target_rows = "\n".join(
        f"| {t.name} | {t.goal} | {t.value} | {'yes' if t.met else '**no**'} |" for t in targets(metrics)
    )
    task_rows = "\n".join(
        f"| {name} | {m['correct']}/{m['total']} | {m['rate']:.1%} |" for name, m in metrics.tasks.items() if m["total"]
    )
    ppl = metrics.perplexity
    calibration = (
        "\nThe student's decision threshold (`router_threshold` in config.json) was then calibrated on "
        f"{recipe.heldout_conversations} whole training conversations: the highest threshold whose student-teacher "
        f"F1 is within {F1_TOLERANCE} of the best, among those processing at most {MAX_PROCESSED:.0%} of tokens."
        if recipe.calibrate_threshold
        else ""
    )
    layer_rows = "\n".join(
        f"| {i} | {metrics.selected_fraction['teacher'][i]:.1%} | {metrics.selected_fraction['student'][i]:.1%} | "
        f"{metrics.student_accuracy[i]:.3f} | {metrics.student_f1[i]:.3f} |"
        for i in range(len(metrics.student_f1))
    )
    phases = (
        f"a dense phase of {recipe.steps} steps, then a gated phase of {recipe.gated_steps} steps with the spec's "
        "optional second pass on selected tokens (`gated_second_pass`)"
        if recipe.gated_steps
        else f"{recipe.steps} steps of the spec's single dense training pass"
    )
    failures = "\n".join(f"- `{q}` → `{a}`" for q, a in metrics.failures) or "- none"
    return f"""{CARD_TITLE}

A tiny Subjective Timescale Transformer (STT) chat model, trained from scratch on a synthetic corpus so that
`chatapp run` works offline out of the box. It is a demonstration model: it calls the calculator for arithmetic
and letter counting, greets, answers a small table of facts (capitals, colours, animal sounds and legs, opposites),
answers in the JSON shape `{{"topic": "...", "answer": "..."}}` when asked for JSON, and thinks inside
`<think>`…`</think>` before answering when asked to think. It knows nothing else.

## Architecture

Qwen2-shaped decoder ({recipe.num_layers} layers, hidden {recipe.hidden_size}, MLP {recipe.intermediate_size},
{recipe.num_heads} attention heads / {recipe.num_kv_heads} KV head(s), tied embeddings, vocabulary {vocab},
context {recipe.context}). Layers {", ".join(map(str, range(1, recipe.num_layers, 2)))} are STT layers with a transition network, the teacher's
predictive router and the student's causal router; at generation time the causal router decides per token whether
the layer's block runs. Weights are stored as `{recipe.store_dtype}` and loaded as float32 on the CPU.

## Data

`chatapp.recipes.tiny.corpus` generates {recipe.train_conversations} training conversations (seed {recipe.seed}):
arithmetic (`+ - * /` on integers, answered through the calculator: text, python `a*b`, python_output, answer),
letter counting (python `"word".count("x")`), facts, small talk, JSON answers and think-then-answer, some
multi-turn or with a system prompt. Tool outputs are computed with `chatapp.tools.calculator.evaluate`, the
engine's own tool. The held-out split ({recipe.heldout_conversations} conversations) shares no question with
training: operands (a hashed fifth of the numbers), letter-counting words, question templates and the JSON / think
requests are partitioned between the splits. Held-out phrasings are new as phrasings but made of words training
phrasings use (training-only phrasings such as `Add {{a}} to {{b}}.` supply them): a model trained from scratch knows a
word only from its corpus. Tokenizer: byte-level BPE trained on the training split with every digit a separate
token{", every lowercase word in double quotes spelled one token per letter" if recipe.spell_quoted_words else ""},
the 9 chat special tokens and `<think>`, `</think>`.

## Training

{phases}, with `chatapp.training.loop` on {recipe.batch_size} windows of {recipe.seq_len} tokens per step (each window
starts at a conversation's start), on the CPU
(training took {train_seconds / 60:.1f} min, the whole build {total_seconds / 60:.1f} min).{calibration}

| recipe field | value |
|---|---|
{recipe_rows}

## Held-out results (student routing, greedy decoding, calculator inline)

| target | goal | measured | met |
|---|---|---|---|
{target_rows}

| task metric | correct | rate |
|---|---|---|
{task_rows}

Perplexity on the assistant tokens of the held-out conversations: routing off {ppl["off"]:.4f}, teacher routing
{ppl["teacher"]:.4f}, student routing {ppl["student"]:.4f} (student / off = {metrics.student_over_off:.3f}).

| STT layer (order) | teacher selects | student selects | student accuracy | student F1 |
|---|---|---|---|---|
{layer_rows}

Some wrong held-out answers:

{failures}

## Reproduce

```
make train-tiny             # = python -m chatapp.recipes.tiny.build
```

The build is seeded end to end (corpus, tokenizer, initialisation, batch order) and runs on the CPU; it writes
this directory only after the new model was evaluated. `chatapp eval` prints the same metrics for this model and
its rebuilds (it knows them by this card's title).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m chatapp.recipes.tiny.build", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=tiny_model_dir(), help="directory to write (replaced)")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke-test recipe (not for shipping)")
    parser.add_argument("--steps", type=int, help="override the dense phase's steps")
    parser.add_argument("--gated-steps", type=int, help="override the gated phase's steps")
    parser.add_argument("--threads", type=int, help="override the recipe's CPU threads")
    parser.add_argument(
        "--seed", type=int, help="override the recipe's seed (corpus, initialisation, batch order): to measure variance"
    )
    args = parser.parse_args(argv)
    recipe = Recipe().quick() if args.quick else Recipe()
    if args.steps is not None:
        recipe = replace(recipe, steps=args.steps)
    if args.gated_steps is not None:
        recipe = replace(recipe, gated_steps=args.gated_steps)
    if args.threads:
        recipe = replace(recipe, threads=args.threads)
    if args.seed is not None:
        recipe = replace(recipe, seed=args.seed)

    def log(message: str) -> None:
        print(message, flush=True)

    metrics = build(recipe, args.out, log)
    for target in targets(metrics):
        log(f"{'ok  ' if target.met else 'MISS'} {target.name}: {target.value} (goal {target.goal})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
