"""The boundary between the TUI and whatever generates tokens.

The app drives a `ChatBackend`: create a session (empty or resumed from history), send a message, regenerate or
edit the last one, switch the TTFA program, change settings, cancel. Every generating call returns a stream of
`Step` events, which is all the UI ever sees of generation: no tensors cross this line. `EngineBackend` wraps the
real `chatapp.engine.ChatSession`; the tests drive the app with a scripted backend that yields predetermined Steps.

Threading: the app iterates a stream in a worker thread and cancels it from that same thread (a generator cannot
be closed while another thread is inside it), so `cancel` is only ever called by the thread iterating the stream.

Start-up: a backend may still be loading its model when the app starts (`ProcessBackend` returns at once and its
engine process loads the model while the app draws and takes keys). Until `ready` is true the app touches only
`model_path`, and `wait_ready`, which it calls in a worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from chatapp.engine.events import Step
from chatapp.engine.lens import LensRequest, ReplyLens
from chatapp.errors import ConversationError
from chatapp.settings import GenerationSettings
from chatapp.tools.base import NANOCHAT_TOOL_MARKERS, ToolMarkers

# The settings a chat starts with: the TUI shows what the model weighed for each token, so it asks for log-probs
# (5 alternatives; their cost is a few percent of a step, see benchmarks/logprobs_cost.py).
TUI_SETTINGS = GenerationSettings(logprobs=5)

StepStream = Generator[Step, None, None]
"""A generating call's events. Stopping early (`close()`) cancels it; the partial answer stays in the session."""

Message = dict[str, Any]
"""A chat message as `chatapp.chat` defines it: `{"role": ..., "content": str | list[part]}`."""


@dataclass(frozen=True)
class ModelInfo:
    """What the UI shows about the loaded model."""

    name: str
    path: str
    device: str
    num_layers: int
    stt_layers: tuple[int, ...]  # the order of `TokenEvent.router_probs`
    context_size: int
    supports_tools: bool
    # The chat format's tool protocol: how the transcript finds a tool call and the history stores one.
    tool_markers: ToolMarkers = NANOCHAT_TOOL_MARKERS
    skip_mode: str = "strict"  # what a skipped token leaves in an STT layer (`STTConfig.skip_mode`)
    skip_cost: float = 0.0  # share of a block a skipped token still computes (`chatapp.compute_saved.skip_cost`)
    routing_levels: tuple[str, ...] = ("default", "off")  # the model's routing levels, its default first
    # The model's own sampling defaults (its generation_config.json): the settings screen says which values are its.
    sampling_defaults: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class ProgramInfo:
    """The active TTFA program: its name (or file path) and the zone tags it declares, in declaration order."""

    name: str
    tags: tuple[str, ...]


class ChatBackend(Protocol):
    """What the chat app needs from a model. Generating calls return a `StepStream` for row 0."""

    @property
    def ready(self) -> bool:
        """The model is loaded: every other member can be used without waiting for it."""
        ...

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds (None: as long as it takes) for the model; True once it is loaded. Raises
        the `ChatappError` that stopped it from loading (`ModelDirError`, a `ProgramError` for the start-up
        program, the start timeout), every time it is called from then on."""
        ...

    @property
    def model_path(self) -> str:
        """The model's directory, known before the model is loaded (`info.path` once it is)."""
        ...

    @property
    def info(self) -> ModelInfo: ...

    @property
    def settings(self) -> GenerationSettings: ...

    @property
    def constraint(self) -> str | None: ...

    @property
    def program(self) -> ProgramInfo | None: ...

    def builtin_programs(self) -> Sequence[str]:
        """Names accepted by `switch_program` besides a `.toml` file path."""
        ...

    def new_session(self, history: Sequence[Message] = ()) -> None:
        """Start a fresh conversation, or one that continues `history` (a resumed chat)."""
        ...

    def send(self, text: str) -> StepStream:
        """Append a user message and stream the assistant's answer."""
        ...

    def regenerate(self) -> StepStream:
        """Drop the last assistant answer and answer the last user message again."""
        ...

    def edit_last(self, text: str) -> StepStream:
        """Replace the last user message (dropping the answer to it) and stream a new answer."""
        ...

    def compare_last(self) -> StepStream:
        """Answer the last user message again with STT routing off, same seed, settings, program and constraint,
        leaving the conversation as it is (the answer is for comparison, not a new turn)."""
        ...

    def switch_program(
        self, name_or_path: str | None, cancel: threading.Event | None = None
    ) -> ProgramInfo | None:
        """Use a built-in program, a `.toml` program file, or none (`None`) from the next answer on.

        Raises `ProgramError` (naming the file and the fix) when it does not load, within the compile budget; the
        old program stays active. Setting `cancel` (from another thread: the compile may take seconds, so the UI
        calls this in a worker) stops the compile and raises `ProgramCancelled`, unless it had already finished.
        """
        ...

    def configure(self, settings: GenerationSettings, constraint: str | None) -> None:
        """Use these settings and regex constraint from the next answer on; `ConstraintError` if it won't compile."""
        ...

    def lens(self, request: LensRequest) -> ReplyLens:
        """The logit lens of one answer of the conversation: every token's decision depth, and the per-layer table
        of token `request.detail` (`chatapp.engine.lens`). Seconds of engine work for a new answer, then a few head
        products per token: the app calls it from a worker thread, never while an answer streams."""
        ...

    def cancel(self, stream: StepStream) -> None:
        """Stop a stream early, keeping the partial answer (called from the thread that iterates the stream).

        The stream may still yield a few steps before it ends (an engine in another process has some in flight);
        the caller keeps iterating until it does, and those steps are part of the answer."""
        ...


class BackendState:
    """The read-only state every backend keeps on the UI's side: the model, and the settings, constraint and program
    of the next answer (set by `configure` / `switch_program`). A backend built on a loaded model is ready from the
    start."""

    _info: ModelInfo
    _settings: GenerationSettings
    _constraint: str | None = None
    _program: ProgramInfo | None = None

    @property
    def ready(self) -> bool:
        return True

    def wait_ready(self, timeout: float | None = None) -> bool:
        return True

    @property
    def model_path(self) -> str:
        return self._info.path

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def settings(self) -> GenerationSettings:
        return self._settings

    @property
    def constraint(self) -> str | None:
        return self._constraint

    @property
    def program(self) -> ProgramInfo | None:
        return self._program


class EngineBackend(BackendState):
    """`ChatBackend` over the real engine: one `ChatSession` at a time on a loaded STT model."""

    def __init__(self, engine: Any, *, model_dir: Path, settings: GenerationSettings | None = None) -> None:
        self._engine = engine
        self._model_dir = model_dir
        self._settings = settings or engine.default_settings(TUI_SETTINGS)
        self._constraint: str | None = None
        self._program: ProgramInfo | None = None
        self._program_object: Any = None
        self._session: Any = None
        self._lens: Any = None  # the last answer's captured lens (`engine.lens_pass.AnswerLens`)
        self._lens_key: tuple[Any, ...] | None = None
        model = engine.model
        config = model.config
        self._info = ModelInfo(
            name=model_dir.name,
            path=str(model_dir),
            device=str(engine.device),
            num_layers=int(config.num_hidden_layers),
            stt_layers=tuple(engine.stt_layers),
            context_size=int(engine.context_size),
            supports_tools=bool(engine.chat_format.supports_tools),
            tool_markers=engine.tool_markers,
            skip_mode=str(getattr(config, "skip_mode", "strict")),
            skip_cost=engine.skip_cost,
            routing_levels=engine.routing_levels,
            sampling_defaults=tuple(engine.sampling_defaults.items()),
        )
        self.new_session()

    @classmethod
    def load(cls, model: str | Path | None, *, device: str | None = None) -> EngineBackend:
        """Load a model by name or directory (raises `ModelDirError` naming what is missing)."""
        from chatapp.models import load_engine, resolve_model

        engine = load_engine(model, device=device)
        return cls(engine, model_dir=resolve_model(model))

    def prepare_in_background(self) -> threading.Thread:
        """Build, in a thread of its own, what the first tool call would otherwise wait for (the grammar's
        vocabulary index, `Engine.prepare_tool_grammars`), while the user writes the first message."""
        thread = threading.Thread(target=self._engine.prepare_tool_grammars, name="chatapp-prepare", daemon=True)
        thread.start()
        return thread

    # --- session ----------------------------------------------------------------------------------------------
    def builtin_programs(self) -> Sequence[str]:
        from chatapp.ttfa import BUILTIN_PROGRAMS

        return tuple(BUILTIN_PROGRAMS)

    def new_session(self, history: Sequence[Message] = ()) -> None:
        self._session = self._engine.session()
        # A resumed conversation costs nothing now: with an empty cache the session renders and prefills all its
        # messages with the next turn.
        self._session.messages.extend(dict(message) for message in history)

    def send(self, text: str) -> StepStream:
        return self._session.send(text, self._settings, **self._options())

    def regenerate(self) -> StepStream:
        return self._session.regenerate(self._settings, **self._options())

    def edit_last(self, text: str) -> StepStream:
        return self._session.edit_last(text, self._settings, **self._options())

    def compare_last(self) -> StepStream:
        messages = self._session.messages
        users = [i for i, message in enumerate(messages) if message["role"] == "user"]
        if not users:
            raise ConversationError("there is no answer to compare yet", hint="send a message first")
        prompt = self._engine.chat_format.render_for_completion(messages[: users[-1] + 1])
        options = self._options()
        steps = self._engine.generate(
            [prompt],
            self._settings.with_(routing="off"),
            programs=None if options["program"] is None else [options["program"]],
            constraints=None if options["constraint"] is None else [options["constraint"]],
        )
        return _closing(steps)

    def switch_program(
        self, name_or_path: str | None, cancel: threading.Event | None = None
    ) -> ProgramInfo | None:
        if name_or_path is None:
            self._program, self._program_object = None, None
            return None
        from chatapp.ttfa import load_program
        from chatapp.ttfa.compiler import ProgramBudget

        program = load_program(
            name_or_path,
            self._engine.tokenizer,
            self._engine.chat_format.program_aliases,
            ProgramBudget(cancel=cancel),
        )
        self._program_object = program
        self._program = ProgramInfo(name=name_or_path, tags=tuple(program.tag_names))
        return self._program

    def set_routing_level(self, level: str | None) -> None:
        """Answer at the model's routing `level` from now on (`--routing`); `SettingsError` naming the model's levels
        when it has no such level."""
        self._settings = self._settings.with_(routing_level=self._engine.resolve_level(level))

    def configure(self, settings: GenerationSettings, constraint: str | None) -> None:
        if constraint:
            from chatapp.trie.regex import compile_regex

            compile_regex(constraint)  # raises ConstraintError naming the regex
        self.configure_checked(settings, constraint)

    def configure_checked(self, settings: GenerationSettings, constraint: str | None) -> None:
        """`configure` for a constraint already compiled elsewhere (the UI process): store it, compile nothing now
        (the engine compiles it, under the same budget, when the next answer starts)."""
        self._settings = settings
        self._constraint = constraint or None

    def cancel(self, stream: StepStream) -> None:
        stream.close()

    def lens(self, request: LensRequest) -> ReplyLens:
        from chatapp.engine.lens_pass import AnswerLens
        from chatapp.engine.loop import call_routing
        from chatapp.models.lens_files import lens_translators

        ids, start, _ = self._answer_ids(request)
        key = (tuple(ids), request.computed)
        if self._lens is None or self._lens_key != key:
            # The conversation replayed through the model's own forward at the routing the answer had: none reported
            # at all means routing was off; else the routers at the settings' threshold decide, as they did.
            dense = all(flags is None for flags in request.computed)
            _, threshold = call_routing(self._engine.model.config, self._settings)
            translators = lens_translators(self._model_dir, self._engine.model.config)
            targets = range(start, start + len(request.tokens))
            self._lens = AnswerLens(
                self._engine, ids, targets, dense=dense, threshold=threshold, translators=translators
            )
            self._lens_key = key
        return self._lens.result(() if request.detail is None else (request.detail,))

    def _answer_ids(self, request: LensRequest) -> tuple[list[int], int, bool]:
        """The conversation's ids up to the end of the answer, where the answer starts, and whether they are the
        tokens the session fed (the answer's run in them, looked for from the end); else the messages before the
        answer rendered for completion (a resumed conversation that has not been fed yet)."""
        tokens, fed = list(request.tokens), list(self._session.token_ids)
        if not tokens:
            raise ConversationError("the answer has no tokens to look through", hint="select a token of an answer")
        for start in range(len(fed) - len(tokens), 0, -1):
            if fed[start : start + len(tokens)] == tokens:
                return fed[: start + len(tokens)], start, True
        answers = [i for i, message in enumerate(self._session.messages) if message["role"] == "assistant"]
        if request.answer >= len(answers):
            raise ConversationError(
                f"answer {request.answer} is not in this conversation", hint="select a token of a shown answer"
            )
        prefix = self._engine.chat_format.render_for_completion(self._session.messages[: answers[request.answer]])
        return [*prefix, *tokens], len(prefix), False

    def _options(self) -> dict[str, Any]:
        return {"program": self._program_object, "constraint": self._constraint}


def _closing(steps: Iterator[Step]) -> StepStream:
    """`steps` as a `StepStream` whose `close()` also closes the engine's stream (freeing its batch at once)."""
    try:
        yield from steps
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()
