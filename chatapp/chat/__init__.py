"""Chat formats: how a conversation becomes token ids, and which of those ids a model is trained on.

Three modules, one job each: `messages.py` the message schema (validation into turns), `nanochat.py` nanochat's
format, `template.py` a checkpoint's own chat template. This package picks a model's format (`chat_format_for`)
and re-exports the public names.

A conversation is a list of message dicts, `{"role": "system" | "user" | "assistant", "content": ...}`. User and
system content is a string; assistant content is a string or a list of parts `{"type": "text" | "python" |
"python_output", "text": str}` (a calculator call and its result, as nanochat writes them).

Two formats share one interface:

- `ChatFormat`, nanochat's: `<|bos|>`, then `<|user_start|>`text`<|user_end|>` and
  `<|assistant_start|>`...`<|assistant_end|>` per turn, tool calls as `<|python_start|>`expr`<|python_end|>` and
  results as `<|output_start|>`value`<|output_end|>`. Used when the tokenizer carries those 9 special tokens.
- `TemplateChatFormat`, a checkpoint's own Jinja chat template (Qwen's `<|im_start|>` ... `<|im_end|>`), rendered
  in a sandbox the way `transformers` renders it, with the checkpoint's tool markers when it names them.

Both keep one promise: text in a message can never produce a structural special token. A user who types
"<|assistant_end|>" gets those characters as ordinary tokens, so typed text cannot end a turn or fake a tool
result. Every format therefore owns a private copy of the tokenizer that encodes structural tokens as text; the
shared tokenizer is never toggled, so formats are safe to use from several threads at once.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from chatapp.chat.messages import Part, Role, Turn, parse_messages
from chatapp.chat.nanochat import ChatFormat
from chatapp.chat.template import TOOL_MARKERS_KEY, TemplateChatFormat, _find_template, _read_json
from chatapp.errors import ModelDirError
from chatapp.special_tokens import CHAT_TOKENS
from chatapp.tools.parts import PART_TYPES, PartType

AnyChatFormat = ChatFormat | TemplateChatFormat


def chat_format_for(tokenizer: Tokenizer, model_dir: str | Path | None = None) -> AnyChatFormat:
    """The chat format for a checkpoint: nanochat's when the tokenizer has its chat tokens, otherwise the
    checkpoint's chat template."""
    missing = [name for name in CHAT_TOKENS.values() if tokenizer.token_to_id(name) is None]
    if not missing:
        return ChatFormat(tokenizer)
    if model_dir is not None and _find_template(Path(model_dir), _read_json(Path(model_dir) / "tokenizer_config.json")):
        return TemplateChatFormat.from_dir(tokenizer, model_dir)
    where = f"{model_dir}" if model_dir is not None else "the tokenizer"
    raise ModelDirError(
        f"{where}: no chat format: the tokenizer lacks {', '.join(missing)} and there is no chat template",
        hint="use a chat (instruct) checkpoint whose tokenizer_config.json has 'chat_template', "
        "or a chatapp checkpoint whose tokenizer has the <|user_start|> ... <|output_end|> tokens",
    )


__all__ = [
    "CHAT_TOKENS",
    "PART_TYPES",
    "TOOL_MARKERS_KEY",
    "AnyChatFormat",
    "ChatFormat",
    "Part",
    "PartType",
    "Role",
    "TemplateChatFormat",
    "Turn",
    "chat_format_for",
    "parse_messages",
]
