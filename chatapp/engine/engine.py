"""The Engine's request front: validate a call, build its rows, and hand them to the decode loop (`loop.py`).

`generate` streams `Step`s for a batch of prompts, `generate_batch` folds them into replies (`reply.py`), and
`session` opens a multi-turn chat (`session.py`) that continues one cache through `continue_turn`. Every input a
caller can get wrong (settings, programs, constraints, a prompt that leaves no room to answer) raises a
`ChatappError` here, before the first step. How a step runs is `loop.py`'s story.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from chatapp.compute_saved import skip_cost
from chatapp.engine.constraints import fresh_constraint
from chatapp.engine.continuous import Admission, ContinuousBatch
from chatapp.engine.detok import Detokenizer, TokenBytes
from chatapp.engine.events import Step
from chatapp.engine.loop import DecodeLoop, RowState
from chatapp.engine.protocols import ChatFormatLike, KVCacheLike, ModelLike
from chatapp.engine.reply import Reply, fold_replies
from chatapp.engine.session import ChatSession, TurnRequest
from chatapp.engine.tools import DEFAULT_MAX_EXPRESSION_TOKENS, ToolBox, ToolMachine
from chatapp.errors import ContextOverflowError, ConversationError, SettingsError
from chatapp.settings import GenerationSettings, with_model_defaults
from chatapp.stt.config import routing_level, routing_levels
from chatapp.tools import TOOLS, Tool
from chatapp.tools.base import NANOCHAT_TOOL_MARKERS, ToolMarkers

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from chatapp.trie.constraint import Constraint
    from chatapp.ttfa import Program

__all__ = ["ChatFormatLike", "Engine", "ModelLike", "TurnRequest"]

CACHE_SLACK = 64  # extra cache slots allocated up front for forced tool output
ADMISSION_REPLY_SLOTS = 256  # cache slots a row joining a running batch starts with for its reply


class Engine:
    """Generation over an STT (or plain Qwen2) model: streaming `generate`, collected `generate_batch`, sessions."""

    def __init__(
        self,
        model: ModelLike,
        tokenizer: Tokenizer,
        chat_format: ChatFormatLike,
        *,
        tools: Iterable[Tool] | None = None,
        context_size: int | None = None,
        max_expression_tokens: int = DEFAULT_MAX_EXPRESSION_TOKENS,
        fast_forward: Literal["auto", "always"] = "auto",
        tool_grammar: bool = True,
        sampling_defaults: Mapping[str, object] | None = None,
    ) -> None:
        """`tool_grammar`: constrain the model's tool calls to each tool's grammar (`FunctionTool.grammar`; the
        calculator's allows arithmetic and `"word".count("x")`); False lets the model write any call.
        `sampling_defaults`: the model's own sampling defaults (`models.generation_config`), which the front-ends
        apply under the user's options (`default_settings`); the engine's own calls take the settings given."""
        self.model = model
        self.tokenizer = tokenizer
        self.chat_format = chat_format
        self.token_bytes = TokenBytes(tokenizer)
        self.context_size = int(context_size or model.config.max_position_embeddings)
        self.loop = DecodeLoop(model, self.context_size, fast_forward, token_bytes=self.token_bytes)
        box = ToolBox(
            TOOLS if tools is None else tools,
            token_id=tokenizer.token_to_id,
            encode_text=chat_format.encode_text,
            decode=chat_format.decode,
            max_expression_tokens=max_expression_tokens,
            markers=getattr(chat_format, "tool_markers", None),
            grammar=self._call_grammar if tool_grammar else None,
        )
        self.toolbox = box if chat_format.supports_tools and box else None
        self._constraint_vocab: Any = None
        self.sampling_defaults: dict[str, object] = dict(sampling_defaults or {})

    @property
    def stt_layers(self) -> list[int]:
        """Indices of the model's STT layers: the order of every routing tuple in the events."""
        return list(self.model.stt_layer_indices)

    @property
    def num_layers(self) -> int:
        """All decoder layers of the model: the denominator of a reply's `compute_saved`."""
        return int(self.model.config.num_hidden_layers)

    @property
    def skip_cost(self) -> float:
        """The share of a block a token its STT layer skips still computes: net of it a reply's `compute_saved`."""
        return skip_cost(self.model.config)

    @property
    def routing_levels(self) -> tuple[str, ...]:
        """The model's routing levels (`GenerationSettings.routing_level`), its default first, "off" last."""
        return tuple(routing_levels(self.model.config))

    def resolve_level(self, level: str | None) -> str:
        """The routing level a request names (None: the model's default), checked against the model's levels
        (`SettingsError` naming them)."""
        return routing_level(self.model.config, level)

    def default_settings(
        self, settings: GenerationSettings = GenerationSettings(), chosen: Collection[str] = ()
    ) -> GenerationSettings:
        """`settings` with this model's sampling defaults in every sampling field not in `chosen` (the fields the
        user set)."""
        return with_model_defaults(settings, self.sampling_defaults, chosen)

    @property
    def tool_markers(self) -> ToolMarkers:
        """The chat format's tool protocol (nanochat's markers for a format that names none)."""
        return getattr(self.chat_format, "tool_markers", None) or NANOCHAT_TOOL_MARKERS

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def fast_forward(self) -> Literal["auto", "always"]:
        """When rows whose settings allow it push known runs through one forward (see `loop.py`)."""
        return self.loop.fast_forward

    def new_reply(self, row: int = 0) -> Reply:
        """An empty reply fold for one row of this engine's output."""
        return Reply(row, self.num_layers, self.stt_layers, self.tool_markers, self.skip_cost)

    # ---------------------------------------------------------------------------------------------- public API
    def generate(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        settings: GenerationSettings | Sequence[GenerationSettings] = GenerationSettings(),
        num_samples: int = 1,
        programs: Sequence[Program | None] | None = None,
        constraints: Sequence[str | Constraint | None] | None = None,
    ) -> Iterator[Step]:
        """Stream `Step`s for `prompts` (token ids, or strings rendered as one user turn). `settings` is one for
        all prompts or one per prompt; `programs` (compiled TTFA programs, `chatapp.ttfa.load_program`) is one
        per prompt, None entries running free; `constraints` (regex strings or `chatapp.trie` Constraints) too.
        Row index = prompt_index * num_samples + sample_index.

        Input errors raise here, before the first step. Closing the returned generator frees everything.
        """
        if num_samples < 1:
            raise SettingsError(f"num_samples must be >= 1, got {num_samples}", hint="ask for at least one sample")
        prompt_ids = [self._prompt_ids(p) for p in prompts]
        per_prompt = self._settings_per_prompt(settings, len(prompt_ids))
        if programs is not None:
            self._check_programs(programs, len(prompt_ids))
        if constraints is not None and len(constraints) != len(prompt_ids):
            raise SettingsError(
                f"got {len(constraints)} constraints for {len(prompt_ids)} prompts", hint="one per prompt"
            )
        for i, ids in enumerate(prompt_ids):
            self._check_fits(i, 0, len(ids))
        initial = max(len(ids) for ids in prompt_ids) + max(s.max_tokens for s in per_prompt) + CACHE_SLACK
        with torch.inference_mode():  # as every cache the engine makes or edits (a compiled CUDA step guards on it)
            cache = self.model.new_cache(len(prompt_ids), min(self.context_size, initial))
        rows = [
            self._new_row(p * num_samples + s, per_prompt[p], None if constraints is None else constraints[p])
            for p in range(len(prompt_ids))
            for s in range(num_samples)
        ]
        row_programs = None if programs is None else [p for p in programs for _ in range(num_samples)]
        return self.loop.stream(prompt_ids, rows, cache, num_samples=num_samples, programs=row_programs)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]] | Sequence[str],
        settings: GenerationSettings | Sequence[GenerationSettings] = GenerationSettings(),
        num_samples: int = 1,
        programs: Sequence[Program | None] | None = None,
        constraints: Sequence[str | Constraint | None] | None = None,
    ) -> list[Reply]:
        """Run `generate` to the end and fold each row's reply (tokens, forced mask, text, finish reason, tools)."""
        steps = self.generate(prompts, settings, num_samples, programs, constraints)
        return fold_replies(
            steps,
            num_layers=self.num_layers,
            stt_layers=self.stt_layers,
            markers=self.tool_markers,
            skip_cost=self.skip_cost,
        )

    def continuous_batch(self) -> ContinuousBatch:
        """A decode batch that requests join (`admission`) and leave between steps: a server's one engine loop."""
        return ContinuousBatch(self.loop, self.model)

    def admission(
        self,
        prompt: Sequence[int] | str,
        settings: GenerationSettings,
        *,
        first_row: int,
        num_samples: int = 1,
        constraint: str | Constraint | None = None,
    ) -> Admission:
        """Check one request (as `generate` does: settings, a prompt that leaves room to answer, the constraint,
        compiled here) and build its `num_samples` rows, numbered from `first_row`, to join a `ContinuousBatch`.
        Only host work: a server runs it in the request's own thread while the loop steps."""
        if num_samples < 1:
            raise SettingsError(f"num_samples must be >= 1, got {num_samples}", hint="ask for at least one sample")
        ids = self._prompt_ids(prompt)
        self._settings_per_prompt(settings, 1)
        self._check_fits(0, 0, len(ids))
        compiled = None if constraint is None else fresh_constraint(constraint, self._regex_constraint)
        rows = [self._new_row(first_row + s, settings, compiled) for s in range(num_samples)]
        # A request that names no max_tokens may run to the context's end (OpenAI's default), but the joined batch
        # takes its largest row's length: start small and let the cache grow on demand (it doubles).
        reply_slots = min(settings.max_tokens, ADMISSION_REPLY_SLOTS)
        cache_len = min(self.context_size, len(ids) + reply_slots + CACHE_SLACK)
        return Admission(ids, rows, cache_len)

    def session(self, system: str | None = None) -> ChatSession:
        """A multi-turn chat that keeps its KV cache between turns (`chatapp.engine.session.ChatSession`)."""
        return ChatSession(self, system=system)

    def turn_request(
        self, settings: GenerationSettings, *, program: Program | None = None, constraint: str | Constraint | None = None
    ) -> TurnRequest:
        """Validate one row's settings, program and constraint now (the constraint is compiled), for
        `continue_turn`; raises the same errors `generate` would."""
        self._settings_per_prompt(settings, 1)
        if program is not None:
            self._check_programs([program], 1)
        compiled = None if constraint is None else fresh_constraint(constraint, self._regex_constraint)
        return TurnRequest(settings, program, compiled)

    def continue_turn(
        self, cache: KVCacheLike, seen: int, segment: list[int], request: TurnRequest
    ) -> Iterator[Step]:
        """Feed `segment` into a one-row `cache` that already holds `seen` tokens, and stream the answer. The
        cache is the caller's: it is grown in place and never compacted (chat sessions keep it between turns)."""
        if not segment:
            raise ConversationError("a turn has no tokens to feed", hint="give the turn some text")
        self._check_fits(0, seen, len(segment))
        row = self._new_row(0, request.settings, request.constraint, seen=seen)
        programs = None if request.program is None else [request.program]
        return self.loop.stream([segment], [row], cache, may_compact=False, programs=programs)

    @property
    def constraint_vocab(self) -> Any:
        """The vocabulary index grammar constraints walk (token bytes, trie): built once per engine, on first use."""
        from chatapp.trie.vocab import ConstraintVocab

        if self._constraint_vocab is None:
            self._constraint_vocab = ConstraintVocab.from_tokenizer(self.tokenizer, self.model.config.vocab_size)
        return self._constraint_vocab

    def prepare_tool_grammars(self) -> None:
        """Build what constraining a tool call needs (the vocabulary index, ~0.5 s for a 49k vocabulary) now, rather
        than when the model first opens a call; a no-op when no tool has a grammar. Safe to run in a thread of its
        own while the engine serves (the index is only read once built)."""
        if self.toolbox is not None and self.toolbox.has_grammars:
            _ = self.constraint_vocab  # built on first use

    def constraint(self, *, regex: str | None = None, json_schema: Any = None) -> Constraint:
        """A `chatapp.trie` Constraint over this model's vocabulary for a regex or a JSON schema, ending at the chat
        format's end of turn. Raises `ConstraintError` naming what is wrong with the pattern or schema."""
        from chatapp.trie.constraint import Constraint

        if (regex is None) == (json_schema is None):
            raise SettingsError(
                "a constraint needs exactly one of a regex or a JSON schema",
                hint="pass either a regex or a JSON schema",
            )
        end = self.chat_format.assistant_end_id
        if regex is not None:
            return Constraint.regex(regex, self.constraint_vocab, end)
        return Constraint.json_schema(json_schema, self.constraint_vocab, end)

    # ------------------------------------------------------------------------------------------------ requests
    def _prompt_ids(self, prompt: Sequence[int] | str) -> list[int]:
        if isinstance(prompt, str):
            return self.chat_format.render_for_completion([{"role": "user", "content": prompt}])
        ids = [int(t) for t in prompt]
        if not ids:
            raise ConversationError("a prompt has no tokens", hint="give at least one token (e.g. <|bos|>)")
        return ids

    @staticmethod
    def _settings_per_prompt(
        settings: GenerationSettings | Sequence[GenerationSettings], prompts: int
    ) -> list[GenerationSettings]:
        per_prompt = [settings] * prompts if isinstance(settings, GenerationSettings) else list(settings)
        if len(per_prompt) != prompts:
            raise SettingsError(f"got {len(per_prompt)} settings for {prompts} prompts", hint="give one per prompt")
        # One model call serves the whole batch, so routing is a property of the call, not of a row.
        if len({(s.routing, s.routing_threshold, s.routing_level) for s in per_prompt}) > 1:
            raise SettingsError(
                "rows of one generate call must share routing and routing_threshold",
                hint="run prompts with different routing settings in separate calls",
            )
        return per_prompt

    @staticmethod
    def _check_programs(programs: Sequence[Any], prompts: int) -> None:
        from chatapp.ttfa import Program

        if len(programs) != prompts:
            raise SettingsError(f"got {len(programs)} programs for {prompts} prompts", hint="give one per prompt")
        for program in programs:
            if program is not None and not isinstance(program, Program):
                raise SettingsError(
                    f"a program must be a compiled TTFA program, got {type(program).__name__}",
                    hint="compile it with chatapp.ttfa.load_program(name_or_path, tokenizer)",
                )

    def _check_fits(self, index: int, used: int, new: int) -> None:
        """A prompt must leave room for at least one generated token."""
        if used + new >= self.context_size:
            raise ContextOverflowError(
                f"prompt {index} needs {used + new} tokens but the model's context holds {self.context_size}, "
                "with no room left to answer",
                hint="shorten the prompt, or start a new conversation",
            )

    def _new_row(
        self, index: int, settings: GenerationSettings, constraint: str | Constraint | None, seen: int = 0
    ) -> RowState:
        """Host state for one request row; `constraint` is a regex string or a `Constraint` (copied fresh)."""
        stops = frozenset(settings.stop_tokens) | frozenset(self.chat_format.stop_token_ids)
        tools = ToolMachine(self.toolbox) if self.toolbox is not None else None
        grammar = None if constraint is None else fresh_constraint(constraint, self._regex_constraint)
        return RowState(index, settings, stops, Detokenizer(self.token_bytes), tools, seen, grammar)

    def _regex_constraint(self, pattern: str) -> Constraint:
        return self.constraint(regex=pattern)

    def _call_grammar(self, pattern: str, end_id: int) -> Constraint:
        """A tool's grammar over this model's vocabulary, ending at the call's end marker (see `tools.py`)."""
        from chatapp.trie.constraint import Constraint

        return Constraint.regex(pattern, self.constraint_vocab, end_id)
