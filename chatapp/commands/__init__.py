"""The commands that build or measure a model (`train`, `eval`, `route`, `convert`) and the ones that only look
(`info`, `models`, `program`): each module holds its command's options and what it does (progress bars, tables,
callbacks, recovering half-written output); `chatapp/cli.py` registers them.

Importing a command module is cheap: torch, the trainers and the recipes are imported inside the command functions,
so `chatapp --help` and the commands that run no model never load them (`tests/cli/test_imports.py`).
"""
