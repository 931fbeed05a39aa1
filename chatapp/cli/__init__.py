"""The `chatapp` command line in one package.

- `table.py`: the table of commands (Typer), the commands that run a model's replies (`run`, `generate`), `calc`,
  and `main`, the console script's entry point;
- one module per command that builds, measures or looks (`train.py`, `eval.py`, `route.py`, `convert.py`,
  `lens.py`, `info.py` for `info` and `models`, `program.py`) and `batch.py`, the front of `chatapp/batch/`: each
  holds its command's options and what it does (progress bars, tables, callbacks, recovering half-written output);
  `table.py` registers them;
- `render.py`: a reply streamed onto the console; `errors.py`: an error as one line on stderr and the exit status;
  `options.py`: the options several command modules take; `prompt_input.py`: a prompt or a schema read from stdin
  or a file.

Importing a command module is cheap: torch, the trainers and the recipes are imported inside the command functions,
so `chatapp --help` and the commands that run no model never load them (`tests/cli/test_imports.py`).
"""

from chatapp.cli.table import app, main

__all__ = ["app", "main"]
