"""`chatapp convert SOURCE OUT_DIR`: a GGUF file or a Qwen2 checkpoint as an STT model directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from chatapp.errors import ModelDirError


def convert(
    source: Annotated[
        str, typer.Argument(help="A llama.cpp GGUF file (Llama or Qwen2 architecture) or a local Qwen2 directory.")
    ],
    out_dir: Annotated[str, typer.Argument(help="Where to write the STT model directory.")],
) -> None:
    """Turn a GGUF file or a Qwen2 checkpoint into an STT model directory (fresh routers; routing off until trained)."""
    from chatapp import store
    from chatapp.errors import DataDirError
    from chatapp.models.gguf import GGUFError, convert_gguf, is_gguf
    from chatapp.models.registry import check_model_output
    from chatapp.settings import locks_dir
    from chatapp.stt import STTForCausalLM
    from chatapp.stt.io import convert_qwen2

    # Everything is checked before the source is read (a GGUF takes seconds to dequantize): the output, then the
    # source's kind. The model is written through the store: staged beside OUT_DIR and renamed into place, so a
    # killed conversion leaves no half directory (and its staging is removed by the next run). OUT_DIR may be new,
    # empty, or an earlier output of chatapp's (its stamp); never a directory of the user's own files.
    target = Path(out_dir).expanduser()
    try:
        check_model_output(target, "output directory")
    except DataDirError:
        if _only_partial_files(target):
            raise ModelDirError(
                f"{target} holds only the temporary files of an interrupted conversion",
                hint=f"remove {target} and run the same `chatapp convert` again",
            ) from None
        raise
    locks = locks_dir()
    source_path = Path(source).expanduser()
    gguf = is_gguf(source_path)
    if not gguf and source_path.suffix.lower() == ".gguf" and source_path.is_file():
        raise GGUFError(
            f"{source_path} is not a GGUF file (it does not start with the GGUF magic bytes)",
            hint="pass a llama.cpp .gguf model file (the download may be incomplete or an HTML page), "
            "or a Qwen2 model directory",
        )
    with store.staged_dir(target, what="output directory", locks=locks, checksums=True) as staging:
        if gguf:
            from rich.progress import Progress

            with Progress(transient=True) as bar:
                task = bar.add_task("reading and dequantizing", total=1)
                model = convert_gguf(
                    source_path, staging, lambda done, total: bar.update(task, completed=done, total=total)
                )
        else:
            model = convert_qwen2(STTForCausalLM, source_path, staging)
    typer.echo(f"wrote {target}: {model.config.num_hidden_layers} layers, STT layers {model.stt_layer_indices}")


def _only_partial_files(directory: Path) -> bool:
    """Whether `directory` is a directory holding nothing but an earlier version's temporary files
    (`.NAME.XXXX.tmp`)."""
    try:
        names = [path.name for path in directory.iterdir()]
    except OSError:
        return False
    return bool(names) and all(name.startswith(".") and name.endswith(".tmp") for name in names)
