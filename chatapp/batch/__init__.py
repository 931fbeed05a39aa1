"""Batch generation over JSONL: `chatapp batch INPUT.jsonl [-o OUTPUT.jsonl]`.

`requests` parses and validates input lines, `runner` batches their rows through the Engine, `records` turns a row's
token stream into its output record, `output` writes records so that a kill never loses or tears one and `--resume`
picks up exactly where a run stopped, `progress` draws the bar on an interactive stderr.
"""
