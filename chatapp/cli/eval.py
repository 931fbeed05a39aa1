"""`chatapp eval [CORPUS]`: held-out perplexity and routing measures of a model, and its recipe's task accuracy."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

from chatapp.cli.options import DeviceOption, ModelOption


def eval_model(
    corpus: Annotated[
        str | None,
        typer.Argument(
            help="Held-out data: JSONL conversations or text (default: the held-out set of the recipe that made "
            "the model: the tiny model's synthetic split, the default model's held-out tool conversations)."
        ),
    ] = None,
    model: ModelOption = None,
    seq_len: Annotated[int, typer.Option("--seq-len", min=2, help="Tokens per window.")] = 256,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Windows per forward.")] = 8,
    max_batches: Annotated[int, typer.Option("--max-batches", min=1, help="Evaluate at most this many.")] = 50,
    device: DeviceOption = None,
    tasks: Annotated[
        int | None,
        typer.Option(
            "--tasks",
            min=0,
            help="Answer N held-out questions of the model's recipe (its sampling defaults, student routing) and report its task "
            "accuracy (default without CORPUS: 300 on the tiny model, 16 on the default model; 0 with one).",
        ),
    ] = None,
    loops: Annotated[
        bool,
        typer.Option(
            "--loops",
            help="Also report the share of replies to 64 held-out open prompts (320 tokens each) that repeat a "
            "6-word run 3+ times, at the model's own sampling defaults and, beside them, greedy and two common "
            "runtimes' defaults (minutes on a CPU).",
        ),
    ] = False,
) -> None:
    """Held-out perplexity with routing off / by the teacher gate g / by the router, tokens processed per STT layer
    and router-vs-gate F1; task accuracy (tool calls, and what else the model's recipe measures) on its held-out
    questions."""
    from itertools import islice

    from rich.table import Table

    from chatapp.errors import TrainingError
    from chatapp.models import load_engine, resolve_model
    from chatapp.recipes.heldout import held_out_for
    from chatapp.training.corpus import check_corpus_path, load_sequences, token_stream
    from chatapp.training.evaluation import MODE_LABELS, conversation_batches, evaluate

    if corpus is not None:
        check_corpus_path(corpus)
    model_dir = resolve_model(model)
    # The model's own held-out set, found before the model loads: a model no recipe made fails at once.
    held_out = held_out_for(model_dir) if corpus is None or tasks else None
    task_count = tasks if tasks is not None else (held_out.default_tasks if corpus is None and held_out else 0)
    engine = load_engine(model, device, dtype="float32")  # the model's own quality, not a lossy format's
    if corpus is None and held_out is not None:
        count = tasks or held_out.default_conversations  # --tasks N also bounds the conversations (a quick look)
        batches = conversation_batches(held_out.conversations(count), engine.chat_format, batch_size)
        data = held_out.description
    else:
        # The first --max-batches windows are all that is evaluated: no more of the corpus is read (or held).
        enough = max_batches * batch_size * seq_len
        stream = token_stream(load_sequences(corpus, engine.tokenizer, engine.chat_format, enough_tokens=enough))
        if stream.num_windows(seq_len) < 1:
            raise TrainingError(f"{corpus} has {len(stream)} tokens, fewer than one window", hint="lower --seq-len")
        batches = stream.batches(batch_size, seq_len)
        data = str(corpus)
    report = evaluate(engine.model, islice(batches, max_batches))
    task_rows = held_out.tasks(engine, task_count) if held_out is not None and task_count else None
    console = Console(highlight=False)
    table = Table(title=f"{model_dir} on {data}: {report.tokens} tokens, skip mode {report.skip_mode}")
    table.add_column("routing by", no_wrap=True)
    table.add_column("held-out perplexity", justify="right")
    table.add_column("block compute saved", justify="right")
    table.add_column("STT-layer tokens skipped", justify="right")
    table.add_column("tokens processed per STT layer")
    for mode, ppl in report.perplexity.items():
        processed = " ".join(f"{f:.0%}" for f in report.selected_fraction[mode])
        saved, skipped = report.compute_saved(mode), report.routed_skipped(mode)
        table.add_row(MODE_LABELS[mode], f"{ppl:.3f}", f"{saved:.1%}", f"{skipped:.1%}", processed)
    console.print(table)
    console.print(
        "router vs teacher gate per STT layer, F1: "
        + " ".join(f"{f:.2f}" for f in report.student_f1)
        + "  accuracy: "
        + " ".join(f"{a:.2f}" for a in report.student_accuracy)
    )
    if task_rows is not None:
        tally_table = Table(title=f"{task_count} held-out questions, the model's sampling, the router deciding")
        tally_table.add_column("task metric")
        tally_table.add_column("accuracy", justify="right")
        for label, tally in task_rows:
            tally_table.add_row(label, str(tally))
        console.print(tally_table)
    if loops:
        from chatapp.recipes.loops import LOOP_REPEATS, LOOP_TOKENS, LOOP_WORDS, loop_table

        loop_reports = loop_table(engine, engine.default_settings(), "this model's defaults")
        loop_table_view = Table(
            title=f"replies that repeat a {LOOP_WORDS}-word run {LOOP_REPEATS}+ times in {LOOP_TOKENS} tokens, "
            "held-out open prompts"
        )
        loop_table_view.add_column("sampling")
        loop_table_view.add_column("replies that loop", justify="right")
        for label, loop_report in loop_reports.items():
            loop_table_view.add_row(label, str(loop_report))
        console.print(loop_table_view)
