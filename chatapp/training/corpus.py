"""From a corpus file to the token streams `chatapp.training.loop` consumes, and the prompt sets `chatapp route` asks.

Two formats: JSONL with one conversation per line (`{"messages": [...]}`, rendered by the model's chat format,
loss on the assistant's tokens only), and plain text (every token is a target; documents are separated by blank
lines and each starts with BOS when the tokenizer has one). A bad line stops loading with an error that names
the file and line: silently dropping training data would hide the mistake.

A routing fit's prompts are the same JSONL, read for their user turns only (the model writes the replies it is fitted
on): `read_dialogues`, and `write_dialogues` for the sets a recipe ships with its model
(`chatapp.models.route_prompts`).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from chatapp.errors import ChatappError, InputLineError, TrainingError
from chatapp.store import atomic_write

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from chatapp.chat import AnyChatFormat
    from chatapp.training.loop import TokenStream

Sequence = tuple[list[int], list[int]]


MAX_LINE_BYTES = 1 << 20
"""Longest line (and, in a text corpus, document) a corpus may hold, in bytes. A corpus is read a line at a time,
and tokenizing text costs ~150 times its size in memory, so this bounds what one corpus line can cost (a 20 MB
line took 3.1 GB)."""
_LIMIT = f"{MAX_LINE_BYTES // (1 << 20)} MiB"


def check_corpus_path(path: str | Path) -> Path:
    """`path` as a corpus that can be opened (a file, or a pipe such as `<(zcat corpus.gz)`), checked before a model
    loads; `TrainingError` saying what it is otherwise."""
    path = Path(path).expanduser()
    hint = "pass a .jsonl conversation file or a text file"
    if path.is_dir():
        raise TrainingError(f"corpus {path} is a directory, not a file", hint=f"{hint} (not a directory)")
    if not path.exists():
        raise TrainingError(f"corpus file {path} does not exist", hint=hint)
    return path


def _lines(path: Path, what: str = "corpus") -> Iterator[tuple[int, str]]:
    """(line number, text without its line end) of each line of `path` (the `what` file, for errors), read one line
    at a time: a line of more than `MAX_LINE_BYTES` is refused by its length before it is decoded."""
    try:
        with path.open("rb") as fh:
            for number, raw in enumerate(iter(lambda: fh.readline(MAX_LINE_BYTES + 2), b""), start=1):
                if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                    raise InputLineError(
                        f"{path}:{number}: the line is longer than {_LIMIT}",
                        hint=f"split line {number} of {path} into lines (documents, conversations) under {_LIMIT}",
                    )
                try:
                    yield number, raw.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as err:
                    raise InputLineError(
                        f"{path}:{number}: not valid UTF-8 ({err.reason} at byte {err.start + 1} of the line)",
                        hint=f"save the {what} as UTF-8 text",
                    ) from None
    except OSError as err:
        raise TrainingError(
            f"cannot read {what} {path}: {err.strerror or err}", hint="use a readable UTF-8 text or JSONL file"
        ) from None


def conversation_records(path: Path, what: str = "corpus") -> Iterator[tuple[str, list]]:
    """("FILE:LINE", messages) of each JSONL line's conversation, as the file is read; blank lines are skipped, and
    a file without one conversation is refused (the `what` file, for errors)."""
    found = False
    for number, line in _lines(path, what):
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
        found = True
        yield where, record["messages"]
    if not found:
        raise TrainingError(f"{what} {path} holds no conversations", hint="add JSONL lines with a 'messages' list")


def conversation_sequences(
    path: Path, chat_format: AnyChatFormat, max_tokens: int | None = None
) -> Iterator[Sequence]:
    """(ids, loss_mask) of each JSONL line's conversation, as the file is read; blank lines are skipped."""
    check_corpus_path(path)
    for where, messages in conversation_records(path):
        try:
            ids, mask = chat_format.render_conversation(messages, max_tokens=max_tokens)
        except ChatappError as err:
            raise InputLineError(f"{where}: {err.message}", hint=err.hint) from None
        yield list(ids), [int(m) for m in mask]


def text_sequences(path: Path, tokenizer: Tokenizer, bos_token: str = "<|bos|>") -> Iterator[Sequence]:
    """Token ids of each blank-line-separated document, every token a target, as the file is read."""
    bos = tokenizer.token_to_id(bos_token)
    found = False
    for document in _documents(path):
        if not document.strip():
            continue
        ids = ([bos] if bos is not None else []) + tokenizer.encode(document, add_special_tokens=False).ids
        found = True
        yield ids, [1] * len(ids)
    if not found:
        raise TrainingError(f"corpus {path} is empty", hint="pass a file with some text in it")


def _documents(path: Path) -> Iterator[str]:
    """The file's text split at every blank line ("\\n\\n", as `str.split` would), read a line at a time; a
    document of more than `MAX_LINE_BYTES` characters is refused, naming the line it starts on."""
    pending, first = "", 1
    check_corpus_path(path)
    for number, line in _lines(path):
        pending = f"{pending}\n{line}" if number > 1 else line
        while "\n\n" in pending:
            document, pending = pending.split("\n\n", 1)
            yield document
            first = number
        if len(pending) > MAX_LINE_BYTES:
            raise InputLineError(
                f"{path}:{first}: the document starting on this line is longer than {_LIMIT}",
                hint=f"separate the documents of {path} with blank lines, each under {_LIMIT}",
            )
    yield pending


def load_sequences(
    path: str | Path, tokenizer: Tokenizer, chat_format: AnyChatFormat | None, enough_tokens: int | None = None
) -> list[Sequence]:
    """Conversations from a .jsonl file (needs a chat format), plain text from anything else. With
    `enough_tokens`, reading stops once the sequences hold that many tokens (an evaluation of N windows in stream
    order reads no more than N windows' worth)."""
    path = Path(path).expanduser()
    if path.suffix == ".jsonl":
        if chat_format is None:
            raise TrainingError(
                f"{path} holds conversations but the tokenizer has no chat format", hint="train on text"
            )
        reader = conversation_sequences(path, chat_format)
    else:
        reader = text_sequences(path, tokenizer)
    sequences, tokens = [], 0
    for sequence in reader:
        sequences.append(sequence)
        tokens += len(sequence[0])
        if enough_tokens is not None and tokens >= enough_tokens:
            reader.close()
            break
    return sequences


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


Dialogue = list[str]
"""What a routing fit has a model answer: one conversation's user turns, in order."""

MAX_DIALOGUE_BYTES = 16 << 20
"""Most text a prompt set may hold: thousands of conversations are far more than a fit answers (its replies are
generated, minutes per hundred), and the whole set is held to draw from it."""


def read_dialogues(path: str | Path, what: str = "--prompts file") -> list[Dialogue]:
    """The user turns of each conversation of a JSONL file (one `{"messages": [...]}` per line, the shape `chatapp
    train` and `chatapp batch` read: other roles' messages are skipped, since the model writes its own replies);
    `InputLineError` naming the line for one without a user turn or with a turn that is not text."""
    return [turns for _, turns in read_dialogue_lines(path, what)]


def read_dialogue_lines(path: str | Path, what: str = "--prompts file") -> list[tuple[str, Dialogue]]:
    """`read_dialogues` with where each conversation is (`FILE:LINE`), for a message about one of them."""
    path = Path(path).expanduser()
    hint = 'pass a .jsonl file with one {"messages": [{"role": "user", "content": "..."}]} per line'
    if path.is_dir():
        raise TrainingError(f"the {what} {path} is a directory, not a file", hint=hint)
    if not path.exists():
        raise TrainingError(f"the {what} {path} does not exist", hint=hint)
    dialogues: list[tuple[str, Dialogue]] = []
    size = 0
    for where, messages in conversation_records(path, what):
        turns = [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        if not turns:
            raise InputLineError(f"{where}: the conversation has no user turn", hint=hint)
        if not all(isinstance(turn, str) and turn.strip() for turn in turns):
            raise InputLineError(f"{where}: a user turn is not text (or is empty)", hint=hint)
        size += sum(len(turn) for turn in turns)
        if size > MAX_DIALOGUE_BYTES:
            raise TrainingError(
                f"the {what} {path} holds more than {MAX_DIALOGUE_BYTES >> 20} MiB of prompts",
                hint="pass a smaller set: a few thousand conversations are plenty",
            )
        dialogues.append((where, turns))
    return dialogues


def write_dialogues(path: Path, dialogues: list[Dialogue]) -> None:
    """Write `dialogues` as `read_dialogues` reads them, whole or not at all."""
    lines = [json.dumps({"messages": [{"role": "user", "content": turn} for turn in turns]}) for turns in dialogues]
    atomic_write(path, lambda staging: staging.write_text("\n".join(lines) + "\n", encoding="utf-8"))
