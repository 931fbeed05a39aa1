"""From a corpus file to the token streams `chatapp.training.loop` consumes.

Two formats: JSONL with one conversation per line (`{"messages": [...]}`, rendered by the model's chat format,
loss on the assistant's tokens only), and plain text (every token is a target; documents are separated by blank
lines and each starts with BOS when the tokenizer has one). A bad line stops loading with an error that names
the file and line: silently dropping training data would hide the mistake.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

from chatapp.errors import ChatappError, InputLineError, TrainingError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from chatapp.chat import AnyChatFormat
    from chatapp.training.loop import TokenStream

Sequence = tuple[list[int], list[int]]


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise TrainingError(f"corpus file {path} does not exist", hint="pass a .jsonl conversation file or a text file")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TrainingError(f"cannot read corpus {path}: {err}", hint="use a UTF-8 text or JSONL file") from None


def conversation_sequences(path: Path, chat_format: AnyChatFormat, max_tokens: int | None = None) -> list[Sequence]:
    """(ids, loss_mask) of each JSONL line's conversation; blank lines are skipped."""
    sequences = []
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise InputLineError(
                f"{where}: not valid JSON ({err.msg})", hint='write one {"messages": [...]} per line'
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("messages"), list):
            raise InputLineError(
                f"{where}: expected an object with a 'messages' list", hint='write {"messages": [...]}'
            )
        try:
            ids, mask = chat_format.render_conversation(record["messages"], max_tokens=max_tokens)
        except ChatappError as err:
            raise InputLineError(f"{where}: {err.message}", hint=err.hint) from None
        sequences.append((list(ids), [int(m) for m in mask]))
    if not sequences:
        raise TrainingError(f"corpus {path} holds no conversations", hint="add JSONL lines with a 'messages' list")
    return sequences


def text_sequences(path: Path, tokenizer: Tokenizer, bos_token: str = "<|bos|>") -> list[Sequence]:
    """Token ids of each blank-line-separated document, every token a target."""
    bos = tokenizer.token_to_id(bos_token)
    sequences = []
    for document in _read_text(path).split("\n\n"):
        if not document.strip():
            continue
        ids = ([bos] if bos is not None else []) + tokenizer.encode(document, add_special_tokens=False).ids
        sequences.append((ids, [1] * len(ids)))
    if not sequences:
        raise TrainingError(f"corpus {path} is empty", hint="pass a file with some text in it")
    return sequences


def load_sequences(path: str | Path, tokenizer: Tokenizer, chat_format: AnyChatFormat | None) -> list[Sequence]:
    """Conversations from a .jsonl file (needs a chat format), plain text from anything else."""
    path = Path(path).expanduser()
    if path.suffix == ".jsonl":
        if chat_format is None:
            raise TrainingError(
                f"{path} holds conversations but the tokenizer has no chat format", hint="train on text"
            )
        return conversation_sequences(path, chat_format)
    return text_sequences(path, tokenizer)


def split_heldout(sequences: list[Sequence], fraction: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """(train, held-out): a seeded `fraction` of the sequences (at least one, never all) held out."""
    if len(sequences) < 2:
        raise TrainingError(
            "the corpus needs at least two conversations or documents to hold one out for evaluation",
            hint="add more conversations or documents, or pass --eval-corpus",
        )
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    count = min(max(1, round(fraction * len(sequences))), len(sequences) - 1)
    held = set(order[:count])
    return [s for i, s in enumerate(sequences) if i not in held], [sequences[i] for i in sorted(held)]


def token_stream(sequences: list[Sequence]) -> TokenStream:
    from chatapp.training.loop import TokenStream

    return TokenStream.from_sequences(sequences)
