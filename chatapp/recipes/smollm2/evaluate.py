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
  student-teacher F1, and decode compute saved; and the compute saved in the model's own replies to held-out open
  prompts and tool questions (`own_replies_saved`);
- multistep: held-out word problems of several steps, of shapes and units the recipe never trains
  (`data.multistep_questions`), right as a tool question is (the call's result and the answer);
- knowledge: `data.KNOWLEDGE_QUESTIONS`, general questions of kinds the recipe never trains, for this model and (with
  "base") the base conversion: what a tune forgot;
- agreement: how closely this model predicts what the base conversion predicts on held-out general text (the base's
  own greedy answers to the open prompts and the knowledge questions, teacher-forced): top-1 agreement and KL(base ||
  model) per answer token, as served and with routing off, means over conversations with their standard errors;
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

import torch

from chatapp.recipes.loops import loop_table
from chatapp.recipes.smollm2 import data
from chatapp.settings import SAMPLING_FIELDS, GenerationSettings
from chatapp.training.evaluation import Tally, conversation_batches, evaluate

HELD_OUT_SEED = 1234  # held-out items are drawn from their own stream, apart from the training seed's
SWITCH_SEED = 999  # the switch pairs' own draw (the model card's 24 pairs)
GREEDY = GenerationSettings()  # the sampling of a score called without one
SECTIONS = (
    "tool",
    "follow-up",
    "switch",
    "general",
    "recall",
    "stt",
    "multistep",
    "knowledge",
    "agreement",
    "loops",
    "base",
)
MULTISTEP_SEED = HELD_OUT_SEED + 6
MULTISTEP_COUNT = 60
AGREEMENT_FILE = "agreement_text.json"  # the base conversion's held-out answers, made once per working directory
AGREEMENT_TOKENS = 160
OWN_REPLY_PROMPTS = 16  # open prompts the model answers for "own replies" (with as many held-out tool questions / 2)
OWN_REPLY_TOKENS = 160


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
    return _tallies(
        _fact_outcomes(engine, list(data.FACT_QUESTIONS)[:count], routing, sampling), data.FACT_QUESTIONS_FIRST
    )


def knowledge_score(engine: Any, routing: str, sampling: GenerationSettings = GREEDY) -> dict[str, Tally]:
    """The knowledge questions of kinds the recipe never trains, scored by keywords (the first 40 apart)."""
    return _tallies(_fact_outcomes(engine, list(data.KNOWLEDGE_QUESTIONS), routing, sampling), 40)


def _fact_outcomes(
    engine: Any, questions: list[data.FactQuestion], routing: str, sampling: GenerationSettings
) -> list[tuple[bool, str]]:
    results = _generate(
        engine, [[{"role": "user", "content": q.question}] for q in questions], routing, sampling=sampling
    )
    return [
        (any(k.lower() in r.text.lower() for k in q.keywords), f"{q.question} -> {r.text!r:.120}")
        for q, r in zip(questions, results, strict=True)
    ]


def multistep_score(engine: Any, count: int, sampling: GenerationSettings = GREEDY) -> Tally:
    """Held-out word problems of several steps: right when the call computes the whole problem and the answer
    quotes its result."""
    items = data.multistep_questions(random.Random(MULTISTEP_SEED), count, held_out=True)
    results = _generate(
        engine, [[{"role": "user", "content": q.question}] for q, _ in items], "student", sampling=sampling
    )
    score = Tally()
    for (item, _), result in zip(items, results, strict=True):
        score.add(_tool_correct(result, item), f"{item.question} [{item.expression}] -> {result.text!r:.160}")
    return score


def agreement_text(work: Path, base_dir: Path) -> list[list[dict[str, Any]]]:
    """The base conversion's greedy answers (routing off, `AGREEMENT_TOKENS` at most) to the open prompts and the
    knowledge questions: held-out general text of kinds the recipe never trains. Made once into `work`."""
    path = work / AGREEMENT_FILE
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    from chatapp.recipes.loops import open_prompts

    prompts = [p.prompt for p in open_prompts()] + [q.question for q in data.KNOWLEDGE_QUESTIONS]
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    results = _generate(_engine(base_dir), conversations, "off", AGREEMENT_TOKENS)
    made = [[*c, {"role": "assistant", "content": r.text}] for c, r in zip(conversations, results, strict=True)]
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(made, indent=1) + "\n", encoding="utf-8")
    return made


@torch.no_grad()
def agreement_score(
    model: Any,
    base: Any,
    chat_format: Any,
    conversations: list[list[dict[str, Any]]],
    routings: dict[str, float | None],
) -> dict[str, dict[str, float]]:
    """Top-1 agreement with `base` and KL(base || model) at the answer tokens of `conversations` (teacher-forced),
    per named routing of `model`: its own routers at a threshold from each answer's first token on (as served: the
    prompt is prefilled densely), or dense for None. The base runs once a conversation for all of them. Means over
    conversations, each with its standard error."""
    from chatapp.recipes.smollm2.refine import padded
    from chatapp.training.tune import TuneBatch, routed_logits, served_routing

    decide = served_routing(model)
    top1: dict[str, list[float]] = {name: [] for name in routings}
    kl: dict[str, list[float]] = {name: [] for name in routings}
    tokens = 0
    for messages in conversations:
        (rows,) = padded([chat_format.render_conversation(messages)], 0)
        batch = TuneBatch(rows.ids, rows.routable, rows.scored, rows.ids[:0, None], torch.zeros(0, 1))
        theirs = routed_logits(base, batch, [], decide, 0.0, base.config.skip_mode)
        tokens += len(theirs)
        for name, threshold in routings.items():
            layers = list(model.stt_layer_indices) if threshold is not None else []
            ours = routed_logits(model, batch, layers, decide, threshold or 0.0, model.config.skip_mode)
            top1[name].append(float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()))
            kl[name].append(float((theirs.exp() * (theirs - ours)).sum(-1).mean()))

    def mean_se(values: list[float]) -> tuple[float, float]:
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / max(len(values) - 1, 1)
        return mean, (var / len(values)) ** 0.5

    out = {}
    for name in routings:
        (a, a_se), (k, k_se) = mean_se(top1[name]), mean_se(kl[name])
        out[name] = {
            "top1": a,
            "top1_se": a_se,
            "kl": k,
            "kl_se": k_se,
            "conversations": len(conversations),
            "tokens": tokens,
        }
    return out


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


def own_replies_saved(engine: Any, sampling: GenerationSettings) -> dict[str, float]:
    """The share of all block work the routers skip, net, in the model's own replies (its sampling, routing as
    served) to held-out open prompts and tool questions: text the model wrote, where the routers skip least."""
    from chatapp.recipes.loops import open_prompts

    prompts = [p.prompt for p in open_prompts()[:OWN_REPLY_PROMPTS]]
    tools = data.tool_questions(random.Random(HELD_OUT_SEED + 7), OWN_REPLY_PROMPTS // 2, held_out=True)
    conversations = [[{"role": "user", "content": p}] for p in prompts + [q.question for q, _ in tools]]
    results = _generate(engine, conversations, "student", OWN_REPLY_TOKENS, sampling)
    tokens = sum(r.routed_tokens for r in results)
    saved = sum(r.compute_saved * r.routed_tokens for r in results) / max(tokens, 1)
    return {"replies": len(results), "tokens": tokens, "compute_saved": saved}


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
    parser.add_argument("--base", default=None, help="the base conversion's directory (default: WORK/base)")
    parser.add_argument(
        "--threshold", type=float, default=None, help="student routing threshold (default: the model's)"
    )
    parser.add_argument(
        "--sampling",
        default=None,
        help="sampling settings over the model's own, as a JSON object, e.g. '{\"temperature\": 0}' for greedy",
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
    if unknown := sorted(sections - set(SECTIONS)):
        parser.error(f"--sections: no section {', '.join(unknown)}; choose from {','.join(SECTIONS)}")
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
        print(
            f"tool {tool['all'].rate:.1%} " + " ".join(f"{k} {v.correct}/{v.total}" for k, v in tool.items()),
            flush=True,
        )
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
        results["stt"]["own_replies"] = own_replies_saved(engine, sampling)
        print(json.dumps(results["stt"]), flush=True)
    if "multistep" in sections:
        multistep = multistep_score(engine, MULTISTEP_COUNT, sampling)
        results["multistep"] = asdict(multistep) | {"rate": multistep.rate}
        print(f"multi-step word problems {multistep}", flush=True)
    if "knowledge" in sections:
        knowledge = knowledge_score(engine, "student", sampling)
        results["knowledge"] = {k: asdict(v) | {"rate": v.rate} for k, v in knowledge.items()}
        print("knowledge " + ", ".join(f"{k} {v.correct}/{v.total}" for k, v in knowledge.items()), flush=True)
    base_dir = Path(args.base) if args.base else work / "base"
    if "agreement" in sections and base_dir.is_dir():
        from chatapp.models.loader import load_model

        text = agreement_text(work, base_dir)
        base_model = load_model(base_dir, dtype=engine.model.weight_format or "float32").model
        routings = {"served": engine.model.config.router_threshold, "routing off": None}
        results["agreement"] = agreement_score(engine.model, base_model, engine.chat_format, text, routings)
        print(f"agreement with the base conversion {json.dumps(results['agreement'])}", flush=True)
    if "loops" in sections:
        # The model card's table: its own defaults beside the references (a --sampling sweep scores its own only;
        # --sampling '{}' the model's defaults alone).
        label = "this model's defaults" if sampling == engine.default_settings() else "--sampling"
        loops = loop_table(engine, sampling, label, references=args.sampling is None)
        results["loops"] = {name: asdict(report) | {"rate": report.rate} for name, report in loops.items()}
        print("loops " + ", ".join(f"{name} {report}" for name, report in loops.items()), flush=True)
    if "base" in sections and not args.skip_base and base_dir.is_dir():
        base_engine = _engine(base_dir)
        scores = {"general": general_score, "knowledge": knowledge_score}
        for name, score in scores.items():
            if name not in sections:
                continue
            tallies = score(base_engine, "off", sampling)
            results[f"{name}_base_routing_off"] = {k: asdict(v) | {"rate": v.rate} for k, v in tallies.items()}
            print(
                f"{name} (base conversion, routing off) "
                + ", ".join(f"{k} {v.correct}/{v.total}" for k, v in tallies.items()),
                flush=True,
            )
    results["seconds"] = time.perf_counter() - began
    work.mkdir(parents=True, exist_ok=True)
    (work / args.out).write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
