"""Held-out evaluation of the default model, the numbers of its model card.

    python -m chatapp.recipes.smollm2.evaluate [--model DIR] [--quick] [--sampling JSON] [--sections LIST]

Everything runs at the model's own sampling defaults (its generation_config.json; `--sampling` overrides fields) and
goes through the Engine the CLI uses (student routing unless the row says otherwise):

- tool: held-out phrasings and values (arithmetic, word problems, percentages, unquoted letter counts); right when
  the model called the calculator with an expression whose result is the expected one and its answer text
  contains that result;
- general: `data.FACT_QUESTIONS` (247) scored by keywords, for this model (student routing) and for the base
  conversion (routing off) side by side; the first 60 apart as well (the card's early rows asked only those);
- follow-up tool: a held-out tool question asked right after another tool exchange in the same conversation
  (right when it makes its own call, not a repeat of the one already in the context);
- recall: a name, number or city given two turns earlier, held-out phrasings and values (160; the first 40 apart);
- STT: perplexity on held-out chat with routing off / student, the fraction of tokens each STT layer processed,
  student-teacher F1, and decode compute saved;
- loops: the share of replies to held-out open prompts that loop (`recipes/loops.py`), at the evaluated sampling
  and, beside it, at `loops.LOOP_REFERENCES` (greedy, the default before the model had its own, and two common
  runtimes' defaults).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from chatapp.recipes.loops import loop_table
from chatapp.recipes.smollm2 import data
from chatapp.settings import SAMPLING_FIELDS, GenerationSettings
from chatapp.training.evaluation import Tally, conversation_batches, evaluate

HELD_OUT_SEED = 1234  # held-out items are drawn from their own stream, apart from the training seed's
SWITCH_SEED = 999  # the switch pairs' own draw (the model card's 24 pairs)
GREEDY = GenerationSettings()  # the sampling of a score called without one
SECTIONS = ("tool", "follow-up", "switch", "general", "recall", "stt", "loops", "base")


def _engine(model_dir: Path) -> Any:
    from chatapp.models import load_engine

    return load_engine(model_dir)


def _generate(
    engine: Any,
    conversations: list[list[dict[str, Any]]],
    routing: str,
    max_tokens: int = 96,
    sampling: GenerationSettings = GREEDY,
) -> list[Any]:
    settings = sampling.with_(max_tokens=max_tokens, routing=routing)
    prompts = [engine.chat_format.render_for_completion(c) for c in conversations]
    results = []
    for start in range(0, len(prompts), 16):
        results += engine.generate_batch(prompts[start : start + 16], settings)
    return results


def _tool_correct(result: Any, item: data.ToolQuestion) -> bool:
    outcomes = [e for e in result.tool_events if e.kind == "result"]
    return any(e.output == item.result for e in outcomes) and item.result in result.text.split(item.expression)[-1]


def tool_score(engine: Any, count: int, sampling: GenerationSettings = GREEDY) -> dict[str, Tally]:
    items = data.tool_questions(random.Random(HELD_OUT_SEED), count, held_out=True)
    results = _generate(
        engine, [[{"role": "user", "content": q.question}] for q, _ in items], "student", sampling=sampling
    )
    scores: dict[str, Tally] = {}
    for (item, _), result in zip(items, results, strict=True):
        ok = _tool_correct(result, item)
        for key in (item.kind, "all"):
            scores.setdefault(key, Tally()).add(ok, f"{item.question} -> {result.text!r:.160}")
    return scores


def follow_up_tool_score(engine: Any, count: int, sampling: GenerationSettings = GREEDY) -> Tally:
    items = data.tool_questions(random.Random(HELD_OUT_SEED + 4), 2 * count, held_out=True)
    firsts, seconds = items[::2], items[1::2]
    conversations = [
        [*data.tool_conversation(*first), {"role": "user", "content": second.question}]
        for first, (second, _) in zip(firsts, seconds, strict=True)
    ]
    results = _generate(engine, conversations, "student", sampling=sampling)
    score = Tally()
    for (first, _), (second, _), result in zip(firsts, seconds, results, strict=True):
        score.add(_tool_correct(result, second), f"{first.question} / {second.question} -> {result.text!r:.160}")
    return score


def switch_tool_scores(engine: Any, count: int, sampling: GenerationSettings = GREEDY) -> dict[str, Tally]:
    """A letter count asked right after an arithmetic exchange, and arithmetic right after a letter count: `count`
    pairs each. The first is where a model repeats the call already in its context ("repeats" counts those)."""
    items = data.tool_questions(random.Random(SWITCH_SEED), 10 * count, held_out=True)
    arithmetic = [i for i in items if i[0].kind == "arithmetic"][:count]
    letters = [i for i in items if i[0].kind == "letters"][:count]
    scores: dict[str, Tally] = {"letters after arithmetic": Tally(), "arithmetic after letters": Tally()}
    repeats = Tally()
    for name, (firsts, seconds) in (
        ("letters after arithmetic", (arithmetic, letters)),
        ("arithmetic after letters", (letters, arithmetic)),
    ):
        conversations = [
            [*data.tool_conversation(*first), {"role": "user", "content": second.question}]
            for first, (second, _) in zip(firsts, seconds, strict=True)
        ]
        results = _generate(engine, conversations, "student", sampling=sampling)
        for (first, _), (second, _), result in zip(firsts, seconds, results, strict=True):
            scores[name].add(
                _tool_correct(result, second), f"{first.question} / {second.question} -> {result.text!r:.160}"
            )
            if name == "letters after arithmetic":
                call = result.text.split(engine.chat_format.tool_markers.call_end)[0]
                repeats.add(first.expression in call, f"{first.expression} in {call!r:.80}")
    scores["repeats"] = repeats
    return scores


RECALL_COUNT, RECALL_FIRST = 160, 40  # the model card's early rows asked the first 40 (the same draw) alone


def _tallies(outcomes: list[tuple[bool, str]], first: int) -> dict[str, Tally]:
    """Tallies of all the outcomes ("all") and of the `first` of them ("first N"): a set whose head is an earlier,
    smaller one."""
    tallies = {"all": Tally(), f"first {first}": Tally()}
    for index, (ok, what) in enumerate(outcomes):
        tallies["all"].add(ok, what)
        if index < first:
            tallies[f"first {first}"].add(ok, what)
    return tallies


def general_score(
    engine: Any, routing: str, sampling: GenerationSettings = GREEDY, count: int | None = None
) -> dict[str, Tally]:
    """The factual questions (the first `count` of them; all without one) scored by keywords."""
    questions = list(data.FACT_QUESTIONS)[:count]
    results = _generate(
        engine, [[{"role": "user", "content": q.question}] for q in questions], routing, sampling=sampling
    )
    outcomes = [
        (any(k.lower() in r.text.lower() for k in q.keywords), f"{q.question} -> {r.text!r:.120}")
        for q, r in zip(questions, results, strict=True)
    ]
    return _tallies(outcomes, data.FACT_QUESTIONS_FIRST)


def recall_score(
    engine: Any, count: int, general: list[tuple[str, str]], sampling: GenerationSettings = GREEDY
) -> dict[str, Tally]:
    rng = random.Random(HELD_OUT_SEED + 1)
    tools = data.tool_questions(random.Random(HELD_OUT_SEED + 2), 20, held_out=True)
    middles = general + [(q.question, data.tool_conversation(q, a)[1]["content"]) for q, a in tools]
    # Drawn one conversation at a time from one stream: the first RECALL_FIRST of a larger count are the same items.
    items = data.recall_conversations(rng, count, middles, held_out=True)
    results = _generate(engine, [messages for _, messages in items], "student", sampling=sampling)
    outcomes = [
        (item.answer.lower() in r.text.lower(), f"{item.fact} / {item.recall} -> {r.text!r:.100}")
        for (item, _), r in zip(items, results, strict=True)
    ]
    return _tallies(outcomes, min(RECALL_FIRST, count))


def stt_report(engine: Any, conversations: list[list[dict[str, Any]]]) -> dict[str, Any]:
    report = evaluate(engine.model, conversation_batches(conversations, engine.chat_format))
    fractions = report.selected_fraction.get("student", [])
    return {
        "tokens": report.tokens,
        "perplexity": report.perplexity,
        "ppl_student_over_off": report.perplexity["student"] / report.perplexity["off"],
        "student_fraction_per_layer": [round(f, 3) for f in fractions],
        "student_fraction_mean": sum(fractions) / len(fractions) if fractions else 1.0,
        "teacher_fraction_per_layer": [round(f, 3) for f in report.selected_fraction.get("teacher", [])],
        "f1_mean": sum(report.student_f1) / len(report.student_f1) if report.student_f1 else 0.0,
        "f1_per_layer": [round(f, 3) for f in report.student_f1],
        "compute_saved": report.compute_saved("student"),  # share of all decoder-layer blocks skipped
        "stt_skipped": report.routed_skipped("student"),  # share of the STT layers' blocks skipped
        "skip_mode": report.skip_mode,
    }


def held_out_chat(general: list[tuple[str, str]], count: int) -> list[list[dict[str, Any]]]:
    """Held-out conversations with answers for perplexity: general answers not trained on, tool calls, recall."""
    plain = [[{"role": "user", "content": p}, {"role": "assistant", "content": a}] for p, a in general]
    tools = [
        data.tool_conversation(q, a) for q, a in data.tool_questions(random.Random(HELD_OUT_SEED + 3), count, True)
    ]
    return plain[:count] + tools


def task_tallies(engine: Any, count: int) -> list[tuple[str, Tally]]:
    """The model card's generated metrics that need no file: held-out tool questions (`count`, by kind), a tool
    question after a tool exchange and recall two turns back (`count // 4` each, at least one), at the model's own
    sampling defaults; for `chatapp eval`.
    The self-distilled general answers held out at training time live in the recipe's working directory, so recall's
    middle turns here are tool exchanges only."""
    sampling = engine.default_settings()  # the model's own sampling, as every command uses it
    tool = tool_score(engine, count, sampling)
    rows = [("tool calls (all kinds)", tool.pop("all"))] + [(f"tool calls: {kind}", t) for kind, t in tool.items()]
    rows.append(("tool call after a tool exchange", follow_up_tool_score(engine, max(1, count // 4), sampling)))
    rows.append(("recall two turns back", recall_score(engine, max(1, count // 4), [], sampling)["all"]))
    return rows


def _sampling(engine: Any, overrides: str | None) -> GenerationSettings:
    """The model's own sampling defaults with the `--sampling` JSON object's fields over them."""
    chosen = json.loads(overrides) if overrides else {}
    return engine.default_settings(GenerationSettings().with_(**chosen), chosen=chosen)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="Held-out evaluation of the default model.")
    parser.add_argument("--work", default="runs/smollm2", help="the recipe's working directory")
    parser.add_argument("--model", default=None, help="model directory (default: the prepared default model)")
    parser.add_argument("--quick", action="store_true", help="small slices (a smoke run)")
    parser.add_argument(
        "--questions",
        type=int,
        default=None,
        help="held-out tool questions (default 100, --quick 20); the follow-up, switch and recall sets scale with it, "
        "and below 100 the factual set is its first 60",
    )
    parser.add_argument("--skip-base", action="store_true", help="do not score the base conversion")
    parser.add_argument(
        "--threshold", type=float, default=None, help="student routing threshold (default: the model's)"
    )
    parser.add_argument(
        "--sampling",
        default=None,
        help='sampling settings over the model\'s own, as a JSON object, e.g. \'{"temperature": 0}\' for greedy',
    )
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"what to score, of {','.join(SECTIONS)}")
    parser.add_argument("--out", default="eval.json", help="file name for the results, in --work")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (1 on a box busier than its cores: a join waits less)"
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    work = Path(args.work)
    from chatapp.recipes.smollm2.train import held_out_general

    general = held_out_general(work)
    if args.model is None:
        from chatapp.models.smollm2 import ensure_prepared

        model_dir = ensure_prepared()
    else:
        model_dir = Path(args.model)
    began = time.perf_counter()
    engine = _engine(model_dir)
    if args.threshold is not None:
        engine.model.config.router_threshold = args.threshold
    sampling = _sampling(engine, args.sampling)
    n = args.questions or (20 if args.quick else 100)
    full = n >= 100
    results: dict[str, Any] = {
        "model": str(model_dir),
        "router_threshold": engine.model.config.router_threshold,
        "sampling": {name: getattr(sampling, name) for name in SAMPLING_FIELDS},
    }
    print(f"sampling {results['sampling']}", flush=True)
    if "tool" in sections:
        tool = tool_score(engine, n, sampling)
        results["tool"] = {k: asdict(v) | {"rate": v.rate} for k, v in tool.items()}
        print(f"tool {tool['all'].rate:.1%} " + " ".join(f"{k} {v.correct}/{v.total}" for k, v in tool.items()), flush=True)
    if "follow-up" in sections:
        follow_up = follow_up_tool_score(engine, 40 if full else max(10, n // 2), sampling)
        results["follow_up_tool"] = asdict(follow_up) | {"rate": follow_up.rate}
        print(f"follow-up tool {follow_up.correct}/{follow_up.total}", flush=True)
    if "switch" in sections:
        switches = switch_tool_scores(engine, 24 if full else max(6, n // 4), sampling)
        results["switch_tool"] = {name: asdict(score) | {"rate": score.rate} for name, score in switches.items()}
        print(", ".join(f"{name} {score.correct}/{score.total}" for name, score in switches.items()), flush=True)
    if "general" in sections:
        general_ours = general_score(engine, "student", sampling, None if full else data.FACT_QUESTIONS_FIRST)
        results["general"] = {k: asdict(v) | {"rate": v.rate} for k, v in general_ours.items()}
        print("general " + ", ".join(f"{k} {v.correct}/{v.total}" for k, v in general_ours.items()), flush=True)
    if "recall" in sections:
        recall = recall_score(engine, RECALL_COUNT if full else max(10, n), general, sampling)
        results["recall"] = {k: asdict(v) | {"rate": v.rate} for k, v in recall.items()}
        print("recall " + ", ".join(f"{k} {v.correct}/{v.total}" for k, v in recall.items()), flush=True)
    if "stt" in sections:
        results["stt"] = stt_report(engine, held_out_chat(general, 10 if args.quick else 40))
        print(json.dumps(results["stt"]), flush=True)
    if "loops" in sections:
        # The model card's table: its own defaults beside the references (a --sampling sweep scores its own only;
        # --sampling '{}' the model's defaults alone).
        label = "this model's defaults" if sampling == engine.default_settings() else "--sampling"
        loops = loop_table(engine, sampling, label, references=args.sampling is None)
        results["loops"] = {name: asdict(report) | {"rate": report.rate} for name, report in loops.items()}
        print("loops " + ", ".join(f"{name} {report}" for name, report in loops.items()), flush=True)
    if "base" in sections and not args.skip_base and (work / "base").is_dir():
        base = general_score(_engine(work / "base"), "off", sampling)
        results["general_base_routing_off"] = {k: asdict(v) | {"rate": v.rate} for k, v in base.items()}
        print(
            "general (base conversion, routing off) "
            + ", ".join(f"{k} {v.correct}/{v.total}" for k, v in base.items()),
            flush=True,
        )
    results["seconds"] = time.perf_counter() - began
    work.mkdir(parents=True, exist_ok=True)
    (work / args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
