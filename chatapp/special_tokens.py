"""The names of nanochat's chat special tokens: the one place they are spelled out.

The chat format resolves them to ids, the tool interface uses the four tool markers as its defaults, the reply
fold recognises a tool call by them, and the tiny model's tokenizer is trained with them. Plain strings, no
imports, so every layer can use them.
"""

from __future__ import annotations

BOS = "<|bos|>"
USER_START = "<|user_start|>"
USER_END = "<|user_end|>"
ASSISTANT_START = "<|assistant_start|>"
ASSISTANT_END = "<|assistant_end|>"
PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
OUTPUT_START = "<|output_start|>"
OUTPUT_END = "<|output_end|>"

# By the `ChatFormat` attribute that holds each id, in the order the tokenizer trainer gives them ids.
CHAT_TOKENS: dict[str, str] = {
    "bos_id": BOS,
    "user_start_id": USER_START,
    "user_end_id": USER_END,
    "assistant_start_id": ASSISTANT_START,
    "assistant_end_id": ASSISTANT_END,
    "python_start_id": PYTHON_START,
    "python_end_id": PYTHON_END,
    "output_start_id": OUTPUT_START,
    "output_end_id": OUTPUT_END,
}
