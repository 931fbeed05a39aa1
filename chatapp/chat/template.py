"""A checkpoint's own Jinja chat template (Qwen's and SmolLM2's `<|im_start|>` ... `<|im_end|>`), rendered in a
sandbox the way `transformers` renders it, with the checkpoint's tool markers when it names them.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from chatapp.chat.messages import Part, Role, TokenizerText, Turn, _drop_trailing_assistant, parse_messages
from chatapp.errors import ConversationError, ModelDirError
from chatapp.special_tokens import ASSISTANT_END, OUTPUT_END, OUTPUT_START, PYTHON_END, PYTHON_START
from chatapp.tools.base import ToolMarkers

# tokenizer_config.json key naming a checkpoint's tool markers (written by the default model's preparation).
TOOL_MARKERS_KEY = "chatapp_tool_markers"


# Sentinels that stand in for message contents when a template is rendered to find where each content lands.
# Private-use code points: no template has a reason to touch them.
_SENTINEL_OPEN, _SENTINEL_CLOSE = "\ue000", "\ue001"


def _sentinel(index: int) -> str:
    return f"{_SENTINEL_OPEN}{index}{_SENTINEL_CLOSE}"


@dataclass(frozen=True, slots=True)
class _Segment:
    """A run of rendered template text: template-written (`role` None) or one message's content."""

    text: str
    role: Role | None
    # An assistant content with tool parts: encoded part by part, markers as their ids (see `_tokenize`).
    parts: tuple[Part, ...] = ()


@dataclass(frozen=True, slots=True)
class _Encoded:
    """A rendered conversation's ids, the segment each id starts in, and which ids are tool output."""

    ids: list[int]
    owners: list[int]
    tool_output: frozenset[int] = frozenset()


class TemplateChatFormat(TokenizerText):
    """A checkpoint's Jinja chat template (tokenizer_config.json / chat_template.jinja), rendered in a sandbox.

    To keep typed special-token text as text, each message's content is located in the rendered string (by
    rendering once more with sentinel contents); a content that would produce a special token is encoded apart
    from the template's own text, anything else is encoded in one piece as `transformers` does. A template that
    rewrites contents (e.g. strips `<think>` blocks from earlier turns) cannot be split that way: completion prompts
    then encode the whole string, refusing contents that contain structural token names, and training masks are
    refused. Loss mask: assistant contents and the template's turn-closing token after each.
    """

    user_start_id = user_end_id = assistant_start_id = None

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        stop_token_ids: Iterable[int] = (),
        source: str = "chat template",
        tool_markers: ToolMarkers | None = None,
    ) -> None:
        super().__init__(tokenizer, structural=None)
        self._bind_tool_markers(tool_markers, source)
        self.template = template
        self._source = source
        self._compiled = _compile_template(template, source)
        self._variables = dict(special_tokens or {})
        added = tokenizer.get_added_tokens_decoder()
        self._structural = [token.content for token in added.values() if token.special]
        self._structural_ids = frozenset(i for i, token in added.items() if token.special)
        bos = self._variables.get("bos_token")
        eos = self._variables.get("eos_token")
        self.bos_id: int | None = tokenizer.token_to_id(bos) if bos else None
        eos_id = tokenizer.token_to_id(eos) if eos else None
        turn_end_id = self._probe_turn_end()
        # The token the template closes an assistant turn with is what the model emits to stop (Qwen: <|im_end|>).
        self.assistant_end_id: int | None = turn_end_id if turn_end_id is not None else eos_id
        candidates = [turn_end_id, eos_id, *stop_token_ids]
        self.stop_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in candidates if i is not None))

    @property
    def program_aliases(self) -> dict[str, str]:
        """nanochat's token names (what built-in TTFA programs are written with) -> this format's tokens."""
        aliases: dict[str, str] = {}
        if self.assistant_end_id is not None and (end := self.tokenizer.id_to_token(self.assistant_end_id)):
            aliases[ASSISTANT_END] = end
        if (markers := self.tool_markers) is not None:
            aliases |= {
                PYTHON_START: markers.call_start,
                PYTHON_END: markers.call_end,
                OUTPUT_START: markers.output_opener,
                OUTPUT_END: markers.output_end,
            }
        return aliases

    def _bind_tool_markers(self, markers: ToolMarkers | None, source: str) -> None:
        """Resolve the tool markers to ids; a checkpoint without them (or whose tokenizer lacks one) has no tools."""
        names = (
            () if markers is None else (markers.call_start, markers.call_end, markers.output_opener, markers.output_end)
        )
        ids = [self.tokenizer.token_to_id(name) for name in names]
        if markers is not None and None in ids:
            raise ModelDirError(
                f"{source}: the tool marker {names[ids.index(None)]!r} is not a token of the tokenizer",
                hint="use the tokenizer the model was converted with, or fix the model's tool markers",
            )
        self.tool_markers = markers
        self.supports_tools = markers is not None
        self.python_start_id, self.python_end_id, self.output_start_id, self.output_end_id = ids or (None,) * 4

    @classmethod
    def from_dir(cls, tokenizer: Tokenizer, model_dir: str | Path) -> TemplateChatFormat:
        """Read the template, its special tokens and the stop ids of `generation_config.json` from a checkpoint."""
        model_dir = Path(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json")
        found = _find_template(model_dir, config)
        if found is None:
            raise ModelDirError(
                f"{model_dir} has no chat template",
                hint="add 'chat_template' to tokenizer_config.json or a chat_template.jinja file",
            )
        template, source = found
        special = {
            key: text
            for key in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (text := _token_text(config.get(key))) is not None
        }
        eos_ids = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        if isinstance(eos_ids, int):
            eos_ids = [eos_ids]
        stop_ids = [i for i in eos_ids or [] if isinstance(i, int)]
        markers = config.get(TOOL_MARKERS_KEY)
        tool_markers = None if markers is None else _tool_markers(markers, model_dir / "tokenizer_config.json")
        return cls(
            tokenizer,
            template,
            special_tokens=special,
            stop_token_ids=stop_ids,
            source=source,
            tool_markers=tool_markers,
        )

    def render_conversation(
        self, messages: Sequence[Mapping[str, Any]], max_tokens: int | None = None
    ) -> tuple[list[int], list[int]]:
        """Ids and loss mask of a whole conversation as the template writes it (no generation prompt)."""
        turns = parse_messages(messages)
        segments = self._segments(turns, add_generation_prompt=False)
        if segments is None:
            raise ConversationError(
                f"the {self._source} rewrites message contents, so assistant tokens cannot be located for a loss mask",
                hint="train with a template that writes each message's content verbatim",
            )
        encoded = self._tokenize(segments)
        ids, owners = encoded.ids, encoded.owners
        # Tool output is written by the calculator at run time, never by the model: not supervised.
        mask = [int(segments[o].role == "assistant" and p not in encoded.tool_output) for p, o in enumerate(owners)]
        # The template's text right after an assistant content starts with the turn-closing token: supervised
        # (through the first stop id), so the model learns to stop.
        closing = {o for o in owners if segments[o].role is None and o > 0 and segments[o - 1].role == "assistant"}
        for owner in closing:
            positions = [p for p, o in enumerate(owners) if o == owner]
            through = _through_first([ids[p] for p in positions], self.stop_token_ids)
            for p in positions[:through]:
                mask[p] = 1
        if max_tokens is not None:
            return ids[:max_tokens], mask[:max_tokens]
        return ids, mask

    def render_for_completion(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Prompt ids for the next assistant answer: the template with `add_generation_prompt=True`."""
        turns = _drop_trailing_assistant(parse_messages(messages))
        segments = self._segments(turns, add_generation_prompt=True)
        if segments is not None:
            return self._tokenize(segments).ids
        for index, turn in enumerate(turns):
            if typed := [name for name in self._structural if name in turn.text]:
                raise ConversationError(
                    f"message {index} contains the special token text {typed[0]!r}, and the {self._source} "
                    "rewrites contents so it cannot be kept as ordinary text",
                    hint=f"remove {typed[0]!r} from the message",
                )
        rendered = self._render(self._messages(turns), add_generation_prompt=True)
        return self.tokenizer.encode(rendered, add_special_tokens=False).ids

    def _tokenize(self, segments: list[_Segment]) -> _Encoded:
        """Ids of the rendered text and, per id, the index of the segment it starts in.

        Normally the whole string is encoded at once, exactly as `transformers` does, so ids match the ones the
        checkpoint was trained on (encoding pieces apart could split a pre-token such as "\n \n" at a boundary).
        When a message's content itself produced a special token (typed "<|im_end|>"), or an assistant content
        holds a tool call, each piece is encoded apart: contents through the encoder that keeps special-token names
        as text, tool markers as their ids.
        """
        starts = list(accumulate((len(s.text) for s in segments[:-1]), initial=0))
        whole = self.tokenizer.encode("".join(s.text for s in segments), add_special_tokens=False)
        owners = [bisect_right(starts, start) - 1 for start, _ in whole.offsets]
        injected = any(
            token in self._structural_ids and segments[owner].role is not None
            for token, owner in zip(whole.ids, owners, strict=True)
        )
        if not injected and not any(s.parts for s in segments):
            return _Encoded(whole.ids, owners)
        ids: list[int] = []
        owners = []
        tool_output: set[int] = set()
        for index, segment in enumerate(segments):
            if segment.parts:
                for part in segment.parts:
                    piece, is_output = self._encode_part(part)
                    if is_output:
                        tool_output.update(range(len(ids), len(ids) + len(piece)))
                    ids += piece
                    owners += [index] * len(piece)
                continue
            encode = self.encode_text if segment.role is not None else self._encode_template_text
            piece = encode(segment.text)
            ids += piece
            owners += [index] * len(piece)
        return _Encoded(ids, owners, frozenset(tool_output))

    def _encode_part(self, part: Part) -> tuple[list[int], bool]:
        """One assistant part's ids, and whether they are tool output. The call's closing marker is the model's
        (supervised) even when it also opens the output block."""
        text = self.encode_text(part.text)
        if part.type == "text":
            return text, False
        if part.type == "python":
            return [self.python_start_id, *text, self.python_end_id], False  # type: ignore[list-item]
        opener = [self.output_start_id] if self.tool_markers and self.tool_markers.output_start else []
        return [*opener, *text, self.output_end_id], True  # type: ignore[list-item]

    def _flat_text(self, turn: Turn) -> str:
        """A turn's content as one string, tool parts wrapped in their marker names (how the template sees it)."""
        if all(part.type == "text" for part in turn.parts):
            return turn.text
        markers = self.tool_markers
        if markers is None:
            raise ConversationError(
                "a message has a tool call, but this model's chat template has no tool markers",
                hint="use a model with tool markers (the default model, or a chatapp checkpoint) for calculator calls",
            )
        return "".join(markers.wrap(p.type)[0] + p.text + markers.wrap(p.type)[1] for p in turn.parts)

    def _messages(self, turns: list[Turn]) -> list[dict[str, str]]:
        return [{"role": turn.role, "content": self._flat_text(turn)} for turn in turns]

    def _encode_template_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> str:
        import jinja2

        try:
            return self._compiled.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        except jinja2.TemplateError as err:  # includes the template's own raise_exception(...)
            raise ConversationError(
                f"the {self._source} refused the conversation: {err}",
                hint="change the conversation as the template asks (roles, order)",
            ) from None

    def _segments(self, turns: list[Turn], *, add_generation_prompt: bool) -> list[_Segment] | None:
        """Split the rendered conversation into template text and verbatim message contents, or None when the
        template does not write contents verbatim (then no split is trustworthy)."""
        real = self._render(self._messages(turns), add_generation_prompt=add_generation_prompt)
        placeholders = [Turn(t.role, (Part("text", _sentinel(i)),)) for i, t in enumerate(turns)]
        skeleton = self._render(self._messages(placeholders), add_generation_prompt=add_generation_prompt)
        segments: list[_Segment] = []
        cursor = 0
        for index, turn in enumerate(turns):
            marker = _sentinel(index)
            count = skeleton.count(marker)
            if count == 0:  # the template left this message out
                continue
            at = skeleton.find(marker, cursor)
            if count > 1 or at < 0:
                return None
            tool_parts = turn.parts if any(part.type != "text" for part in turn.parts) else ()
            segments += [_Segment(skeleton[cursor:at], None), _Segment(self._flat_text(turn), turn.role, tool_parts)]
            cursor = at + len(marker)
        segments.append(_Segment(skeleton[cursor:], None))
        if _SENTINEL_OPEN in skeleton[cursor:] or "".join(s.text for s in segments) != real:
            return None
        return [s for s in segments if s.text or s.role is not None]

    def _probe_turn_end(self) -> int | None:
        """The first structural special token the template writes after an assistant's content, if any."""
        probe = [Turn("user", (Part("text", _sentinel(0)),)), Turn("assistant", (Part("text", _sentinel(1)),))]
        try:
            rendered = self._render(self._messages(probe), add_generation_prompt=False)
        except ConversationError:
            return None
        at = rendered.find(_sentinel(1))
        if at < 0:
            return None
        tail = rendered[at + len(_sentinel(1)) :]
        positions = [(tail.find(name), name) for name in self._structural if name in tail]
        return self.tokenizer.token_to_id(min(positions)[1]) if positions else None


def _tool_markers(value: object, source: Path) -> ToolMarkers:
    fields = ("call_start", "call_end", "output_end")
    if not isinstance(value, Mapping) or any(not isinstance(value.get(k), str) for k in fields):
        raise ModelDirError(
            f"{source}: {TOOL_MARKERS_KEY!r} must be an object with string fields {', '.join(fields)}",
            hint="fix that entry of the model's config, or convert the model again",
        )
    opener = value.get("output_start")
    return ToolMarkers(
        value["call_start"], value["call_end"], opener if isinstance(opener, str) else None, value["output_end"]
    )


def _through_first(ids: list[int], stops: Collection[int]) -> int:
    """Length of the prefix of `ids` up to and including the first stop id (0 if none)."""
    return next((i + 1 for i, token in enumerate(ids) if token in stops), 0)


def _compile_template(template: str, source: str) -> Any:
    """Compile like transformers does: an immutable sandbox (templates are untrusted code), trim/lstrip blocks,
    `raise_exception`, a `tojson` that keeps non-ASCII, loop controls, and `{% generation %}` accepted."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for transformers' masks; render the body."""

        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    def strftime_now(fmt: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ModelDirError(
            f"the {source} is not valid Jinja: {err} (line {err.lineno})",
            hint="fix the chat template, or convert the model again",
        ) from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelDirError(f"cannot read {path}: {err}", hint="restore the file from the checkpoint") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} must hold a JSON object", hint="fix the file, or convert the model again")
    return data


def _find_template(model_dir: Path, config: Mapping[str, Any]) -> tuple[str, str] | None:
    """The chat template and where it came from: `chat_template.jinja` (newer transformers) wins over
    tokenizer_config.json's `chat_template`, which is a string or a list of named templates."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), f"chat template {jinja_file}"
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        template = named.get("default", next(iter(named.values()), None))
    if isinstance(template, str) and template.strip():
        return template, f"chat template in {model_dir / 'tokenizer_config.json'}"
    return None


def _token_text(value: object) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict with 'content'."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) and value else None
