"""`chatapp info` and `chatapp models`: what is installed and where, and the models `--model` can name."""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from chatapp import __version__


def info() -> None:
    """Show versions, the compute device, and where config, data, history and the default model live."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from chatapp.models.loader import is_complete_model_dir
    from chatapp.models.registry import default_model_name, model_listing
    from chatapp.settings import config_dir, data_dir, data_dir_problem, history_db_path

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} GPU(s))"
    else:
        device = f"cpu ({torch.get_num_threads()} threads)"
    default = next(entry for entry in model_listing() if entry.name == default_model_name())  # nothing is prepared
    from chatapp.stt import cpu_step

    kernel = cpu_step.library_path()  # reported, not built here
    if kernel.is_file():
        kernel_state = f"{kernel} (built)"
    elif problem := cpu_step.compiler_problem():
        kernel_state = f"cannot be built: {problem}; int8 decodes with torch's step"
    else:
        kernel_state = f"{kernel} (not built yet: built at the first int8 load, or by `make kernels`)"
    rows = {
        "chatapp": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": installed("transformers"),
        "textual": installed("textual"),
        "device": device,
        "int8 kernel": kernel_state,
        "config dir": str(config_dir()),
        "data dir": str(data_dir()) + (f" (not usable: {problem})" if (problem := data_dir_problem()) else ""),
        "history db": str(history_db_path()),
        "default model": f"{default.path} ({'present' if is_complete_model_dir(default.path) else 'missing'})",
    }
    for key, value in rows.items():
        typer.echo(f"{key + ':':<15}{value}")


def models() -> None:
    """List the models --model NAME can name: where each lives, its size, context, STT layers and skip mode,
    prepared or not."""
    from rich.table import Table

    from chatapp.models.registry import default_model_name, model_listing

    table = Table(box=None, pad_edge=False)
    for column in ("name", "parameters", "context", "STT layers", "skip mode", "routing levels", "state"):
        table.add_column(column)
    table.add_column("path", overflow="fold")
    for entry in model_listing():
        name = f"{entry.name} (default)" if entry.name == default_model_name() else entry.name
        table.add_row(
            name,
            entry.parameters,
            entry.context,
            entry.stt_layers,
            entry.skip_mode,
            entry.levels,
            entry.state,
            str(entry.path),
        )
    Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200).print(table)
