"""`chatapp train CORPUS --out DIR`: train an STT model (fine-tune a model, or one from a config), with a progress
bar, held-out evaluations as it goes, and the finished model written beside its checkpoints."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from chatapp.cli.options import DeviceOption
from chatapp.errors import ChatappError


def _training_inputs(model_dir: str | None, init: str | None, tokenizer_path: str | None, device: str | None):
    """(model, tokenizer, chat format or None, dir to copy tokenizer files from) for `train`."""
    from pathlib import Path

    import torch
    from tokenizers import Tokenizer

    from chatapp.chat import chat_format_for
    from chatapp.errors import ModelDirError, TrainingError
    from chatapp.models import resolve_model
    from chatapp.models.loader import resolve_device
    from chatapp.stt import STTConfig, STTForCausalLM

    if (model_dir is None) == (init is None):
        raise TrainingError("pass exactly one of --model DIR or --init CONFIG.json", hint="see `chatapp train --help`")
    source = resolve_model(model_dir) if model_dir else Path(tokenizer_path or "").expanduser()
    tokenizer_file = source / "tokenizer.json" if source.is_dir() else source
    if not tokenizer_file.is_file():
        raise ModelDirError(f"no tokenizer at {tokenizer_file}", hint="--init needs --tokenizer DIR|tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    resolved = resolve_device(device)
    if model_dir is not None:
        model = STTForCausalLM.from_pretrained(source, device=resolved, dtype=torch.float32)
    else:
        try:
            config = STTConfig.from_json_file(str(Path(init).expanduser()))
            config.validate_stt()
        except Exception as err:  # any parse or validation failure is the config file's fault
            from chatapp.stt.config import config_problem

            raise TrainingError(
                f"cannot use {init} as a model config: {config_problem(err)}", hint="write an STTConfig JSON"
            ) from None
        if config.vocab_size < tokenizer.get_vocab_size():
            raise TrainingError(
                f"{init}: vocab_size {config.vocab_size} < the tokenizer's {tokenizer.get_vocab_size()}",
                hint="use a config whose vocab_size is at least the tokenizer's, or another tokenizer",
            )
        model = STTForCausalLM(config).to(resolved)
    try:
        chat_format = chat_format_for(tokenizer, source if source.is_dir() else None)
    except ChatappError:
        chat_format = None
    return model, tokenizer, chat_format, tokenizer_file.parent


def train(
    corpus: Annotated[str, typer.Argument(help="Training data: JSONL conversations ({'messages': [...]}) or text.")],
    out: Annotated[str, typer.Option("--out", help="Output directory: checkpoints and the final model.")],
    model: Annotated[
        str | None, typer.Option("--model", help="The model to fine-tune: a name (tiny) or a model directory.")
    ] = None,
    init: Annotated[str | None, typer.Option("--init", help="STTConfig JSON to train from scratch.")] = None,
    tokenizer: Annotated[
        str | None, typer.Option("--tokenizer", help="With --init: a tokenizer.json or a directory holding one.")
    ] = None,
    eval_corpus: Annotated[
        str | None, typer.Option("--eval-corpus", help="Held-out data (default: 5% of CORPUS held out).")
    ] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Optimiser steps.")] = 1000,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per step (per GPU).")] = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per window.")] = 256,
    lr_scale: Annotated[float, typer.Option("--lr-scale", help="Multiplies every group's learning rate.")] = 1.0,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Linear learning-rate warmup steps.")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Seed for batch order and held-out split.")] = 0,
    eval_interval: Annotated[int, typer.Option("--eval-interval", min=0, help="Evaluate every N steps (0: end).")] = 0,
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint in --out.")] = False,
    device: DeviceOption = None,
) -> None:
    """Train an STT model (teacher targets, causal router, TPN, LM loss); multi-GPU with torchrun."""
    from pathlib import Path

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from chatapp import store
    from chatapp.models.registry import check_model_output, check_not_builtin
    from chatapp.stt.io import copy_tokenizer_files
    from chatapp.training.corpus import check_corpus_path, load_sequences, split_heldout, token_stream
    from chatapp.training.evaluation import MODE_LABELS
    from chatapp.training.loop import TrainConfig, init_distributed, latest_checkpoint
    from chatapp.training.loop import train as run_training

    # --out: new, empty, or an earlier run's (its checkpoints, or the stamp a finished run leaves), which this run
    # continues (--resume) or writes again; never a directory of the user's own files, never a built-in model.
    target = Path(out).expanduser()
    if target.is_dir() and (store.is_complete(target) or latest_checkpoint(target) is not None):
        check_not_builtin(target, "--out directory")
        store.check_writable_dir(target, "--out directory", create=False)
    else:
        check_model_output(target, "--out directory")
    for path in (corpus, eval_corpus):
        if path is not None:
            check_corpus_path(path)
    dist_info = init_distributed()
    if dist_info.world_size > 1 and device is None:
        device = f"cuda:{dist_info.local_rank}" if torch.cuda.is_available() else "cpu"
    net, tok, chat_format, tokenizer_dir = _training_inputs(model, init, tokenizer, device)
    sequences = load_sequences(corpus, tok, chat_format)
    if eval_corpus is not None:
        heldout = load_sequences(eval_corpus, tok, chat_format)
    else:
        sequences, heldout = split_heldout(sequences, 0.05, seed)
    config = TrainConfig(
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr_scale=lr_scale,
        warmup_steps=warmup,
        seed=seed,
        eval_interval=eval_interval,
    )
    console = Console(stderr=True)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console, disable=not dist_info.is_main) as progress:
        task = progress.add_task("training", total=steps)

        def on_step(report) -> None:
            selected = " ".join(f"{f:.2f}" for f in report.teacher_fraction)
            progress.update(
                task,
                completed=report.step,
                description=f"loss {report.losses['lm']:.3f}  {report.tokens_per_s:,.0f} tok/s  "
                f"gate selects [{selected}]",
            )
            if report.eval is not None:
                ppl = ", ".join(f"{MODE_LABELS[mode]} {value:.2f}" for mode, value in report.eval.perplexity.items())
                progress.console.print(
                    f"step {report.step}: held-out perplexity {ppl}; router-vs-gate F1 "
                    + " ".join(f"{f:.2f}" for f in report.eval.student_f1)
                )

        run_training(
            net,
            token_stream(sequences),
            config,
            eval_data=token_stream(heldout),
            out_dir=out,
            resume=resume,
            on_step=on_step,
            dist_info=dist_info,
        )
    if dist_info.is_main:
        copy_tokenizer_files(tokenizer_dir, Path(out))
        store.write_stamp(out)  # a finished run's: the next `chatapp train --out` here may write it again
        typer.echo(f"saved the trained model to {out}")
