"""Training the default model's parts: LoRA adapters, the tool markers' embedding rows, STT routers.

Phase A (dense): LoRA on every linear layer of the blocks (peft, injected into the STT model) and the embedding rows
of the three tool-marker tokens learn the tool protocol on tool, general (self-distilled) and recall conversations;
the routers and transition networks already learn from the teacher alongside (their losses read detached
activations, so they cost little and start phase B warm). Phase B turns on the gated second pass (docs/stt.md
§3.1 step 6): each STT layer's output for the LM loss is its routed recomputation, so the adapters learn to
tolerate the skips while the routers settle. The β schedule spans both phases.

The marker rows are trained through the tied embedding matrix with a gradient hook that zeroes every other row:
Adam's update of a parameter whose gradient is always zero is exactly zero, so the other 49,149 rows stay bitwise
the base model's. Only trainable tensors are checkpointed (atomically, every `CHECKPOINT_EVERY` steps), so a killed
run resumes from its last checkpoint with the same data order.

The step loop is the one every trainer runs (`training.steps`); what is this recipe's own is what a step computes
(whole conversations batched by length with padding, where the generic loop cuts a token stream into windows, and
the model's config switched between phases), the learning rate of each group (LoRA, masked embedding rows, routers),
one clipping norm per group, and checkpoints of the trainable tensors only. It shares the learning rate schedule
(`training.schedule`), the checkpoint writer (`training.checkpoint`) and the threshold calibration.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatapp.recipes.smollm2 import data
from chatapp.tools.base import JUPYTER_TOOL_MARKERS
from chatapp.training.checkpoint import save_state
from chatapp.training.schedule import warmup_cosine
from chatapp.training.steps import Clipping, Steps

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 16
LORA_ALPHA = 32
ROUTER_PARTS = ("transition_network", "predictive_router", "causal_router")
# Router sizes chosen to keep the shipped parts small (fp16: ~5 MB of transition networks, ~4 MB of routers).
TRANSITION_HIDDEN = 144
CAUSAL_ROUTER_HIDDEN = 64


@dataclass(frozen=True)
class Recipe:
    tool_conversations: int = 1320  # 220 per entry of data.TRAIN_KINDS
    recall_conversations: int = 480
    chained_conversations: int = 360
    general_repeats: int = 1
    steps_a: int = 150
    steps_b: int = 45
    tokens_per_step: int = 1280  # padded tokens per batch (conversations of similar length share a batch)
    lr_lora_a: float = 3e-4
    lr_lora_b: float = 1e-4
    lr_rows: float = 2e-3
    warmup: int = 10
    pad_id: int = 0


CHECKPOINT_EVERY = 20
# The teacher of phase B: the top half of each sequence by gate score (fixed capacity, docs/stt.md §4). With the
# threshold rule on SmolLM2 the gate saturated (β → 100 with a transition network that cannot predict this model's
# residuals, so the expected-event criterion passes ~90% of tokens at g == 1.0 exactly); a moderate final β keeps g
# graded so its ranking means something. The second pass follows the teacher's decisions: following the student's
# own (what inference runs) taught the adapters to skip and cost dense quality (measured; model card).
TEACHER = {
    "use_g_threshold_selection": False,
    "capacity": 0.5,
    "beta_ce_end": 4.0,
    "beta_cu_end": 4.0,
}
# STT layers: the six odd layers whose skipping costs SmolLM2 least. Measured on held-out chat with every other layer
# dense and half the tokens of one layer skipped at random: layer 1 alone raised the loss from 0.72 to 3.14 and layer
# 29 to 1.62; 17, 5, 3, 7, 9 and 25 cost 0.04-0.13 each. Skipping in all 15 odd layers (even 20% of tokens) left a
# loss above 2 after the gated phase, far from the dense 0.2-0.5.
STT_LAYERS = [3, 5, 7, 9, 17, 25]
# The student's shipped threshold. The F1 calibration picked 0.4 (its argmax over 0.2-0.8, before `calibrate` took
# the tiny recipe's rule in `training.calibrate`), where the students skip about half of the STT layers' tokens, but
# held-out tool accuracy then falls far (22/25 routing off, 8/25 at 0.4): skipped tokens break the operand copying
# the calculator calls need. Swept on 40 held-out tool questions (int8, greedy): 0.05 ->
# 33/40 with ~5% of STT tokens skipped, 0.15 -> 24/40 with ~14% (model card). Quality first: the lowest measured
# threshold that keeps routing-off accuracy. Users can raise it (`routing_threshold`) to watch more skipping.
SHIPPED_ROUTER_THRESHOLD = 0.05
HELD_OUT_GENERAL = 40  # distilled answers kept out of training: held-out chat for the perplexity metrics
HELD_OUT_FILE = "held_out_general.json"


def split_general(work: Path, general: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Drop repetitive answers, keep the last `HELD_OUT_GENERAL` apart (written for the evaluation); the rest trains."""
    usable = [(p, a) for p, a in general if not data.repetitive(a)]
    train, held = usable[:-HELD_OUT_GENERAL], usable[-HELD_OUT_GENERAL:]
    (work / HELD_OUT_FILE).write_text(json.dumps(held, indent=1) + "\n", encoding="utf-8")
    return train


def held_out_general(work: Path) -> list[tuple[str, str]]:
    path = work / HELD_OUT_FILE
    return [tuple(pair) for pair in json.loads(path.read_text(encoding="utf-8"))] if path.is_file() else []


def conversations(general: list[tuple[str, str]], seed: int, recipe: Recipe) -> list[list[dict[str, Any]]]:
    """The training mix: tool calls, the base model's own general answers, recall, and chains of exchanges."""
    rng = random.Random(seed + 1)
    tool = [
        data.tool_conversation(q, a)
        for q, a in data.tool_questions(rng, recipe.tool_conversations, held_out=False, kinds=data.TRAIN_KINDS)
    ]
    plain = [[{"role": "user", "content": p}, {"role": "assistant", "content": a}] for p, a in general]
    middles = [(c[0]["content"], c[1]["content"]) for c in plain + tool[: len(plain) // 2]]
    recall = [m for _, m in data.recall_conversations(rng, recipe.recall_conversations, middles, held_out=False)]
    # Short general answers only: a chain of long ones would not fit a batch.
    short = [c for c in plain if len(c[1]["content"]) < 400]
    chained = data.chained_conversations(rng, recipe.chained_conversations, tool, short)
    mix = tool + plain * recipe.general_repeats + recall + chained
    rng.shuffle(mix)
    return mix


def encode(chat_format: Any, mix: list[list[dict[str, Any]]]) -> list[tuple[list[int], list[int]]]:
    return [chat_format.render_conversation(messages) for messages in mix]


def batches(encoded: list[tuple[list[int], list[int]]], recipe: Recipe, seed: int, epoch: int) -> list[list[int]]:
    """Indices of conversations per batch: shuffled, then grouped by length so little of a batch is padding."""
    rng = random.Random(seed * 1000 + epoch)
    order = list(range(len(encoded)))
    rng.shuffle(order)
    out = []
    for start in range(0, len(order), 256):  # sort within chunks: similar lengths, still a shuffled stream
        chunk = sorted(order[start : start + 256], key=lambda i: len(encoded[i][0]))
        current: list[int] = []
        for i in chunk:
            width = max([len(encoded[j][0]) for j in current] + [len(encoded[i][0])])
            if current and width * (len(current) + 1) > recipe.tokens_per_step:
                out.append(current)
                current = []
            current.append(i)
        if current:
            out.append(current)
    rng.shuffle(out)
    return out


def collate(
    encoded: list[tuple[list[int], list[int]]], index: list[int], pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(encoded[i][0]) for i in index)
    ids = torch.full((len(index), width), pad, dtype=torch.long)
    mask = torch.zeros((len(index), width), dtype=torch.long)
    for row, i in enumerate(index):
        seq, supervised = encoded[i]
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = torch.tensor(supervised)
    return ids, mask


def build_model(base: Path, steps: int) -> tuple[Any, list[int]]:
    """The base STT model with fresh small routers, LoRA injected, marker rows trainable; returns it and the rows."""
    from peft import LoraConfig, inject_adapter_in_model
    from tokenizers import Tokenizer

    from chatapp.stt import STTForCausalLM
    from chatapp.stt.io import load_config, load_state_dict

    config, _ = load_config(base)
    config.stt_layers = list(STT_LAYERS)
    config.transition_hidden_size = TRANSITION_HIDDEN
    config.causal_router_hidden_size = CAUSAL_ROUTER_HIDDEN
    config.beta_warmup_steps = steps
    torch.manual_seed(0)
    model = STTForCausalLM(config)
    state = load_state_dict(base)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict({k: v for k, v in state.items() if not any(p in k for p in ROUTER_PARTS)}, strict=False)
    for param in model.parameters():
        param.requires_grad_(False)
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS), lora_dropout=0.0)
    model = inject_adapter_in_model(lora, model)
    for name, param in model.named_parameters():
        if "lora_" in name or any(p in name for p in ROUTER_PARTS):
            param.requires_grad_(True)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    markers = JUPYTER_TOOL_MARKERS
    rows = [tokenizer.token_to_id(n) for n in (markers.call_start, markers.call_end, markers.output_end)]
    embedding = model.model.embed_tokens.weight
    embedding.requires_grad_(True)
    keep = torch.zeros(embedding.shape[0], 1)
    keep[rows] = 1.0
    embedding.register_hook(lambda grad: grad * keep.to(grad.dtype))
    return model, rows


def param_groups(model: Any, recipe: Recipe) -> list[dict[str, Any]]:
    config = model.config
    groups: dict[str, list[torch.nn.Parameter]] = {"lora": [], "rows": [], "tpn": [], "predictive": [], "causal": []}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if "lora_" in name:
            groups["lora"].append(param)
        elif "transition_network" in name:
            groups["tpn"].append(param)
        elif "predictive_router" in name:
            groups["predictive"].append(param)
        elif "causal_router" in name:
            groups["causal"].append(param)
        else:
            groups["rows"].append(param)
    lrs = {
        "lora": recipe.lr_lora_a,
        "rows": recipe.lr_rows,
        "tpn": config.lr_transition_network,
        "predictive": config.lr_predictive_router,
        "causal": config.lr_causal_router,
    }
    return [{"name": k, "params": v, "lr": lrs[k], "base_lr": lrs[k], "weight_decay": 0.0} for k, v in groups.items()]


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def run(
    work: Path,
    base: Path,
    general: list[tuple[str, str]],
    *,
    seed: int,
    log: Callable[[str], None],
    recipe: Recipe = Recipe(),
) -> None:
    """Phases A and B, resumable from `work/train.pt`; the final trainable state goes to `work/trained.pt`."""
    from tokenizers import Tokenizer

    from chatapp.chat import chat_format_for

    general = split_general(work, general)
    final = work / "trained.pt"
    if final.is_file():
        log("training already done")
        return
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    total = recipe.steps_a + recipe.steps_b
    model, rows = build_model(base, total)
    chat_format = chat_format_for(Tokenizer.from_file(str(base / "tokenizer.json")), base)
    encoded = encode(chat_format, conversations(general, seed, recipe))
    log(
        f"{len(encoded)} conversations, {sum(len(e[0]) for e in encoded)} tokens, "
        f"{sum(sum(e[1]) for e in encoded)} supervised"
    )
    groups = param_groups(model, recipe)
    optimizer = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    step = 0
    checkpoint = work / "train.pt"
    resume = checkpoint if checkpoint.is_file() else work / "phase_a.pt"
    if resume.is_file():
        saved = torch.load(resume, weights_only=False)
        wanted = dict(model.named_parameters())
        model.load_state_dict({k: v for k, v in saved["trainable"].items() if k in wanted}, strict=False)
        try:
            optimizer.load_state_dict(saved["optimizer"])
        except ValueError:  # other STT layers than the checkpoint's: phase B starts with fresh optimizer state
            log("optimizer state not reused (the trainable parameters changed)")
        step = saved["step"]
        log(f"resumed from {resume.name} at step {step}")
    plan: list[list[int]] = []
    epoch = 0
    while len(plan) < total:
        plan += batches(encoded, recipe, seed, epoch)
        epoch += 1
    began, seen = time.perf_counter(), 0

    def compute(at: int) -> Any:
        nonlocal seen
        phase_b = at >= recipe.steps_a
        model.config.gated_second_pass = phase_b
        if phase_b:
            for key, value in TEACHER.items():
                setattr(model.config, key, value)
        ids, mask = collate(encoded, plan[at], recipe.pad_id)
        seen += ids.numel()
        return model.forward_train(ids, mask, step=at, all_logits=False)

    def lr(at: int, group: dict[str, Any]) -> float:
        phase_b = at >= recipe.steps_a
        factor = warmup_cosine(
            at - recipe.steps_a if phase_b else at, recipe.steps_b if phase_b else recipe.steps_a, recipe.warmup
        )
        return (recipe.lr_lora_b if (phase_b and group["name"] == "lora") else group["base_lr"]) * factor

    def after(done: int, out: Any) -> None:
        if done % 5 == 0 or done == total:
            rate = seen / (time.perf_counter() - began)
            losses = " ".join(f"{k} {v.item():.3f}" for k, v in out.losses.items())
            fraction = out.stats["teacher_fraction"].mean().item()
            f1 = out.stats["f1"].mean().item()
            phase = "B" if done > recipe.steps_a else "A"
            log(f"step {done}/{total} {phase} {losses} teacher {fraction:.2f} f1 {f1:.2f} {rate:.0f} tok/s")
        if done == recipe.steps_a:  # the dense model, kept apart: phase B can be rerun from it
            save_state(
                {"trainable": trainable_state(model), "optimizer": optimizer.state_dict(), "step": done},
                work / "phase_a.pt",
            )

    def save(done: int) -> None:
        save_state({"trainable": trainable_state(model), "optimizer": optimizer.state_dict(), "step": done}, checkpoint)

    model.train()
    Steps(
        optimizer,
        compute,
        lr,
        # Per group: the transition networks' regression loss has the scale of SmolLM2's residual stream (hundreds),
        # and one global norm would shrink the adapters' gradients to nothing.
        clip=Clipping([group["params"] for group in groups], 1.0),
        after=after,
        checkpoint=save,
        checkpoint_every=CHECKPOINT_EVERY,
    ).run(step, total)
    save_state({"trainable": trainable_state(model), "rows": rows, "recipe": recipe.__dict__}, final)
    log("training done")


def export(work: Path, base: Path, *, log: Callable[[str], None]) -> Path:
    """Write the shipped parts (fp16) and their manifest into the package; see `chatapp.models.smollm2`."""
    from safetensors.torch import save_file

    from chatapp.models.smollm2 import PARTS_DIR, write_manifest

    trained = torch.load(work / "trained.pt", weights_only=False)
    state = trained["trainable"]
    rows: list[int] = trained["rows"]
    parts: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "model.embed_tokens.weight":
            parts["token_rows"] = tensor[rows].to(torch.float32).contiguous()
        elif "lora_" in name:
            parts[name.replace(".default", "")] = tensor.to(torch.float16).contiguous()
        else:
            parts[name] = tensor.to(torch.float16).contiguous()
    PARTS_DIR.mkdir(parents=True, exist_ok=True)
    save_file(parts, str(PARTS_DIR / "parts.safetensors"), metadata={"format": "pt"})
    calibration = json.loads((work / "calibration.json").read_text()) if (work / "calibration.json").is_file() else {}
    write_manifest(
        token_rows=rows,
        lora={"rank": LORA_RANK, "alpha": LORA_ALPHA, "targets": list(LORA_TARGETS)},
        stt={
            "transition_hidden_size": TRANSITION_HIDDEN,
            "causal_router_hidden_size": CAUSAL_ROUTER_HIDDEN,
            "router_threshold": SHIPPED_ROUTER_THRESHOLD if calibration else 0.5,
            "routing_trained": True,
            "stt_layers": list(STT_LAYERS),
            "beta_warmup_steps": Recipe().steps_a + Recipe().steps_b,
            **TEACHER,
        },
    )
    size = (PARTS_DIR / "parts.safetensors").stat().st_size
    log(f"exported {len(parts)} tensors, {size / 1e6:.1f} MB")
    return PARTS_DIR


def export_routing(model_dir: Path, *, log: Callable[[str], None]) -> Path:
    """Ship the routing that `chatapp route` fitted on the prepared default model (`model_dir`): its STT layers'
    router parts (and skip predictors, in "predict" mode) replace those in `parts.safetensors`, and the manifest's
    STT settings follow its config (its routing levels too). The causal routers stay float32: each layer's calibrated
    cutoff sits in its output bias (`chatapp.training.route`).

    When the fit also tuned the backbone (`--tune-steps`), its adapters ship too: the routed model's merged adapters
    are the recipe's LoRA and the tune's side by side ([B1 B2] [A1; A2], scale folded into B), so they replace the
    parts' LoRA as one adapter of the summed rank, and preparation rebuilds exactly the tuned weights."""
    from safetensors.torch import load_file, save_file

    from chatapp.models.smollm2 import MANIFEST_FILE, PARTS_DIR, PARTS_FILE, write_manifest
    from chatapp.stt.io import CONFIG_NAME, ROUTER_PARTS, WEIGHTS_NAME, load_merged_adapters

    config = json.loads((model_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    routed = load_file(model_dir / WEIGHTS_NAME)
    parts = {k: v for k, v in load_file(PARTS_DIR / PARTS_FILE).items() if not any(p in k for p in ROUTER_PARTS)}
    for name, tensor in routed.items():
        if any(part in name for part in ROUTER_PARTS):
            dtype = torch.float32 if ".causal_router." in name else torch.float16
            parts[name] = tensor.to(dtype).contiguous()
    manifest = json.loads((PARTS_DIR / MANIFEST_FILE).read_text(encoding="utf-8"))
    adapters = load_merged_adapters(model_dir)
    if adapters:  # the routed model's own: a tune's joined to what it had merged, or those it had merged alone
        rank = next(iter(adapters.values()))[0].shape[0]
        scale = manifest["lora"]["alpha"] / manifest["lora"]["rank"]  # kept: B is stored over the same scale
        parts = {k: v for k, v in parts.items() if "lora_" not in k}
        for module, (a, b) in adapters.items():
            parts[f"{module}.lora_A.weight"] = a.to(torch.float16).contiguous()
            parts[f"{module}.lora_B.weight"] = (b / scale).to(torch.float16).contiguous()
        manifest["lora"].update(rank=rank, alpha=scale * rank)
        log(f"exported the tuned backbone's adapters: rank {rank}")
    save_file(parts, str(PARTS_DIR / PARTS_FILE), metadata={"format": "pt"})
    keys = ("stt_layers", "skip_mode", "router_threshold", "routing_trained", "causal_router_hidden_size")
    manifest["stt"].update({key: config[key] for key in keys})
    # "predict" mode's predictors, the levels `route` measured, and whether prompts are routed (default: yes)
    for key in ("predictor_rank", "routing_levels", "route_prompt"):
        if config.get(key) is not None and not (key == "route_prompt" and config[key]):
            manifest["stt"][key] = config[key]
        else:
            manifest["stt"].pop(key, None)
    write_manifest(**{k: v for k, v in manifest.items() if k not in ("format", "base", "tool_markers")})
    log(f"exported the routing of {model_dir}: STT layers {config['stt_layers']}, skip mode {config['skip_mode']}")
    return PARTS_DIR


def calibrate(
    work: Path, model_dir: Path, general: list[tuple[str, str]], *, seed: int, log: Callable[[str], None]
) -> float:
    """The student's decision threshold by the one calibration rule (`training.calibrate`) on 48 training
    conversations, each its own batch (whole conversations, as generation sees them), written to
    `work/calibration.json` for `export`."""
    from chatapp.models.loader import load_model
    from chatapp.training.calibrate import calibrate_router_threshold

    loaded = load_model(model_dir, dtype="float32")  # the precision the routers were trained in
    mix = conversations(split_general(work, general), seed, Recipe())[:48]
    batches = [(torch.tensor([loaded.chat_format.render_conversation(m)[0]]), None) for m in mix]
    found = calibrate_router_threshold(loaded.model, batches)
    log(f"calibration: threshold {found.threshold} (mean F1 {found.f1:.3f}, {found.processed:.1%} processed)")
    record = {"router_threshold": found.threshold, "f1": found.f1, "processed": found.processed}
    (work / "calibration.json").write_text(json.dumps(record) + "\n")
    return found.threshold
