"""A scripted `ChatBackend`: yields predetermined Steps so UI tests are fast and exact.

It behaves like a chat session where it matters to the UI (messages, programs that can fail to load, a regex
constraint that can fail to compile, cancellation) and records what the app asked of it.
"""

from __future__ import annotations

import math
import re
import threading
import time
import tomllib
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from chatapp.engine.events import Alternative, PromptInfo, Step, TokenEvent, TokenLogprobs, ToolEvent
from chatapp.engine.lens import LayerLens, LensAlternative, LensRequest, ReplyLens, TokenLens
from chatapp.engine.reply import Reply
from chatapp.errors import ChatappError, ConstraintError, ProgramError
from chatapp.settings import GenerationSettings
from chatapp.ui.backend import BackendState, Message, ModelInfo, ProgramInfo, StepStream

STT_LAYERS = (1, 3, 5, 7)
INFO = ModelInfo(
    name="scripted-8L",
    path="/models/scripted-8L",
    device="cpu",
    num_layers=8,
    stt_layers=STT_LAYERS,
    context_size=2048,
    supports_tools=True,
)
PROGRAMS = {"chat": (), "think": ("think", "answer"), "calc": ("prose", "calc")}
_SPECIAL_IDS = {
    "<|assistant_end|>": 5,
    "<|python_start|>": 6,
    "<|python_end|>": 7,
    "<|output_start|>": 8,
    "<|output_end|>": 9,
    "<think>": 10,
    "</think>": 11,
}


def token_id(text: str, special: bool) -> int:
    """A stable token id for a text (specials get the chat tokenizer's small ids)."""
    return _SPECIAL_IDS[text] if special else 16 + zlib.crc32(text.encode()) % 480


def routing(position: int, layers: int = len(STT_LAYERS)) -> tuple[tuple[float, ...], tuple[bool, ...]]:
    """Deterministic router probabilities for a token position, and the decisions at threshold 0.5."""
    probs = tuple(((position * 7 + layer * 3) % 11) / 10 for layer in range(layers))
    return probs, tuple(p >= 0.5 for p in probs)


def tok(
    text: str,
    *,
    forced: bool = False,
    special: bool = False,
    tags: tuple[str, ...] = (),
    zone: str | None = None,
    tool: ToolEvent | None = None,
    position: int = 0,
    fed: bool = True,
    finish: str | None = None,
) -> TokenEvent:
    probs, computed = routing(position) if fed else (None, None)
    return TokenEvent(
        row=0,
        token=token_id(text, special),
        forced=forced,
        text=text,
        special=special,
        tags=tags,
        zone=zone,
        router_probs=probs,
        computed=computed,
        tool=tool,
        finish_reason=finish,  # type: ignore[arg-type]
    )


def answer(*pieces: str | TokenEvent, end: bool = True, with_logprobs: bool = False) -> list[TokenEvent]:
    """Tokens from pieces (a str is a sampled token), positions filled in, ending in a sampled stop token; with
    scripted log-probs (`logprobs`) if asked."""
    events = [piece if isinstance(piece, TokenEvent) else tok(piece) for piece in pieces]
    if end:  # the stop token is emitted in the zone of the token before it
        last = events[-1] if events else tok("")
        events.append(tok("<|assistant_end|>", special=True, fed=False, finish="stop", tags=last.tags, zone=last.zone))
    return [_at(event, i, with_logprobs) for i, event in enumerate(events)]


def _at(event: TokenEvent, position: int, with_logprobs: bool = False) -> TokenEvent:
    fields = {**_fields(event), "logprobs": logprobs(event, position) if with_logprobs else event.logprobs}
    if event.router_probs is not None:
        fields["router_probs"], fields["computed"] = routing(position)
    return TokenEvent(**fields)


def logprobs(event: TokenEvent, position: int) -> TokenLogprobs:
    """Deterministic log-probs for a token position: the token's probability cycles through likely and surprising
    values; two made-up alternatives share the rest of the mass (0.6 / 0.3 of it)."""
    p = (0.97, 0.6, 0.15, 0.85, 0.03, 0.4, 0.99)[position % 7]
    own = Alternative(event.token, event.text.encode(), math.log(p))
    rest = [Alternative(token_id(t, False), t.encode(), math.log((1 - p) * share)) for t, share in ((" the", 0.6), (" a", 0.3))]
    top = tuple(sorted([own, *rest], key=lambda a: -a.logprob))
    entropy = -sum(math.exp(a.logprob) * a.logprob for a in top)
    drawn = not event.forced
    return TokenLogprobs(
        logprob=own.logprob,
        piece=own.piece,
        entropy=entropy,
        top=top,
        sampling_logprob=own.logprob if drawn else None,
        sampling_top=top if drawn else (),
    )


def _fields(event: TokenEvent) -> dict[str, object]:
    return {name: getattr(event, name) for name in TokenEvent.__slots__}


def steps(events: Sequence[TokenEvent], *, prompt_tokens: int = 12, seconds: float = 0.02) -> list[Step]:
    """One Step per token (the first carries the prefill), each taking `seconds`."""
    info = PromptInfo(
        rows=1, prompt_tokens=(prompt_tokens,), prefill_seconds=0.05, context_used=(prompt_tokens,), context_size=2048
    )
    return [
        Step(
            index=i,
            tokens=(event,),
            seconds=seconds,
            active_rows=int(i < len(events) - 1),
            prompt=info if i == 0 else None,
        )
        for i, event in enumerate(events)
    ]


# --- canned answers ----------------------------------------------------------------------------------------------
def greeting(with_logprobs: bool = False) -> list[TokenEvent]:
    return answer("Hello", "!", " How", " can", " I", " help", " you", " today", "?", with_logprobs=with_logprobs)


def think_answer() -> list[TokenEvent]:
    think, ans = ("think",), ("answer",)
    return answer(
        tok("<think>", forced=True, special=True, tags=think, zone="open"),
        tok("Paris", tags=think, zone="think"),
        tok(" is", tags=think, zone="think"),
        tok(" the", tags=think, zone="think"),
        tok(" capital", tags=think, zone="think"),
        tok(".", tags=think, zone="think"),
        tok("</think>", forced=True, special=True, tags=think, zone="think"),
        tok("The", tags=ans, zone="answer"),
        tok(" capital", tags=ans, zone="answer"),
        tok(" of", tags=ans, zone="answer"),
        tok(" France", tags=ans, zone="answer"),
        tok(" is", tags=ans, zone="answer"),
        tok(" Paris", forced=True, tags=ans, zone="answer"),
        tok(".", tags=ans, zone="answer"),
    )


def calculator_answer(expression: str = "37*45", result: str = "1665", with_logprobs: bool = False) -> list[TokenEvent]:
    call = ToolEvent("call", "calculator", expression)
    outcome = ToolEvent("result", "calculator", expression, result)
    return answer(
        "Let", " me", " compute", " that", ".",
        tok("<|python_start|>", special=True),
        *expression_tokens(expression),
        tok("<|python_end|>", special=True, tool=call),
        tok("<|output_start|>", forced=True, special=True, tool=outcome),
        tok(result, forced=True),
        tok("<|output_end|>", forced=True, special=True),
        f" {expression}", " is", f" {result}", ".",
        with_logprobs=with_logprobs,
    )  # fmt: skip


def expression_tokens(expression: str) -> list[TokenEvent]:
    return [tok(piece) for piece in re.findall(r"\d+|\D", expression)]


class ScriptedBackend(BackendState):
    """A `ChatBackend` that answers from a queue of scripted token lists (the last one repeats)."""

    def __init__(
        self, answers: Iterable[Sequence[TokenEvent]] = (), *, seconds: float = 0.02, delay: float = 0.0
    ) -> None:
        self.answers = [list(a) for a in answers] or [greeting()]
        self.seconds = seconds  # what each Step reports (drives tokens/s)
        self.delay = delay  # real time each step takes (to spread a stream over several UI batches)
        self.calls: list[tuple[str, str | None]] = []
        self.sessions: list[list[Message]] = []
        self.messages: list[Message] = []
        self.cancelled = 0
        # A test can hold the stream after `hold_after` steps until `release` is set (to cancel mid-answer).
        self.hold_after: int | None = None
        self.release = threading.Event()
        # A test can make the next generating call refuse (as a session does when the context is full).
        self.refuse: ChatappError | None = None
        self.held = threading.Event()
        # A test can make the stream fail after its last step (the engine process killed after the answer ended),
        # and make every later call fail as a dead engine process's would.
        self.fail_after: ChatappError | None = None
        self.dead: ChatappError | None = None
        # A test can compile program files for real (the TTFA compiler and its budget) against this tokenizer.
        self.tokenizer = None
        self.compile_seconds = 10.0
        self.compiles: list[tuple[str | None, bool]] = []  # (program, cancelled) per switch_program call
        # What `compare_last` answers (routing off): None repeats the last answer streamed (identical).
        self.compare_answer: list[TokenEvent] | None = None
        self.lens_requests: list[LensRequest] = []  # what the app asked `lens` for
        self._last_answer: list[TokenEvent] = []
        # A test can keep the model "loading" (clear `loaded` before building the app, set it to finish), and make
        # the load fail with `load_error` (an engine process that cannot load its model directory).
        self.loaded = threading.Event()
        self.loaded.set()
        self.load_error: ChatappError | None = None
        self._info = INFO
        self._settings = GenerationSettings()
        self._constraint: str | None = None
        self._program: ProgramInfo | None = None

    @property
    def ready(self) -> bool:
        return self.loaded.is_set() and self.load_error is None

    def wait_ready(self, timeout: float | None = None) -> bool:
        if not self.loaded.wait(timeout):
            return False
        if self.load_error is not None:
            raise self.load_error
        return True

    def builtin_programs(self) -> Sequence[str]:
        return tuple(PROGRAMS)

    def new_session(self, history: Sequence[Message] = ()) -> None:
        if self.dead is not None:
            raise self.dead
        self.messages = [dict(m) for m in history]
        self.sessions.append(list(self.messages))

    def send(self, text: str) -> StepStream:
        self._check_refusal()
        self.calls.append(("send", text))
        self.messages.append({"role": "user", "content": text})
        return self._stream()

    def regenerate(self) -> StepStream:
        self._check_refusal()
        self.calls.append(("regenerate", None))
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        return self._stream()

    def edit_last(self, text: str) -> StepStream:
        self._check_refusal()
        self.calls.append(("edit_last", text))
        while self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        self.messages[-1] = {"role": "user", "content": text}
        return self._stream()

    def compare_last(self) -> StepStream:
        self._check_refusal()
        self.calls.append(("compare_last", None))
        events = self.compare_answer if self.compare_answer is not None else self._last_answer
        yield from steps(events, seconds=self.seconds)

    def switch_program(
        self, name_or_path: str | None, cancel: threading.Event | None = None
    ) -> ProgramInfo | None:
        if name_or_path is None:
            self._program = None
        elif name_or_path in PROGRAMS:
            self._program = ProgramInfo(name_or_path, PROGRAMS[name_or_path])
        elif self.tokenizer is not None:
            from chatapp.ttfa import load_program
            from chatapp.ttfa.compiler import ProgramBudget, ProgramCancelled

            try:
                program = load_program(
                    name_or_path, self.tokenizer, budget=ProgramBudget(self.compile_seconds, cancel)
                )
            except ProgramCancelled:
                self.compiles.append((name_or_path, True))
                raise
            self.compiles.append((name_or_path, False))
            self._program = ProgramInfo(name_or_path, tuple(program.tag_names))
        else:
            self._program = ProgramInfo(name_or_path, _load_program_file(Path(name_or_path)))
        return self._program

    def configure(self, settings: GenerationSettings, constraint: str | None) -> None:
        if constraint:
            try:
                re.compile(constraint)
            except re.error as err:
                raise ConstraintError(f"constraint {constraint!r}: {err}", hint="fix the regular expression") from None
        self._settings, self._constraint = settings, constraint or None

    def cancel(self, stream: StepStream) -> None:
        self.cancelled += 1
        stream.close()

    def lens(self, request: LensRequest) -> ReplyLens:
        if self.dead is not None:
            raise self.dead
        self.lens_requests.append(request)
        return scripted_lens(request)

    def _check_refusal(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self.refuse is not None:
            error, self.refuse = self.refuse, None
            raise error

    def _stream(self) -> StepStream:
        events = self.answers.pop(0) if len(self.answers) > 1 else list(self.answers[0])
        self._last_answer = events
        emitted: list[TokenEvent] = []
        try:
            for i, step in enumerate(steps(events, seconds=self.seconds)):
                if self.hold_after is not None and i == self.hold_after:
                    self.held.set()
                    self.release.wait(timeout=10)
                if self.delay:
                    time.sleep(self.delay)
                emitted.extend(step.tokens)
                yield step
            if self.fail_after is not None:
                self.dead, self.fail_after = self.fail_after, None
                raise self.dead
        finally:
            self.messages.append({"role": "assistant", "content": Reply.of(emitted).content})


def scripted_lens(request: LensRequest, num_layers: int = INFO.num_layers) -> ReplyLens:
    """A deterministic layer lens for an answer: token i is settled at layer (3 i) mod (L + 1) (never, at L); the
    emitted token's probability rises through the layers, and a routed layer that skipped the predicting position
    (the previous token's routing) repeats the layer below, as the real lens does."""
    slots = {layer: slot for slot, layer in enumerate(STT_LAYERS)}
    tokens = []
    for i, token in enumerate(request.tokens):
        depth = (3 * i) % (num_layers + 1)
        previous = request.computed[i - 1] if i else None
        flags = tuple(previous) if previous is not None else (True,) * len(STT_LAYERS)
        layers: list[LayerLens] = []
        for layer in range(num_layers):
            routed = layer in slots
            computed = flags[slots[layer]] if routed else True
            if layers and not computed:
                below = layers[-1]
                layers.append(LayerLens(layer, routed, computed, below.prob, below.rank, below.top))
                continue
            settled = layer >= depth
            prob = round(0.5 + 0.5 * (layer + 1) / num_layers, 2) if settled else round(0.05 * (layer + 1), 2)
            own = LensAlternative(token, f"t{token}", prob)
            rest = (LensAlternative(token_id(" the", False), " the", round((1 - prob) * 0.6, 2)),
                    LensAlternative(token_id(" a", False), " a", round((1 - prob) * 0.3, 2)))
            top = tuple(sorted((own, *rest), key=lambda alternative: -alternative.prob))
            layers.append(LayerLens(layer, routed, computed, prob, top.index(own) + 1, top))
        tokens.append(
            TokenLens(
                index=i,
                position=12 + i,
                token=token,
                text=f"t{token}",
                decision_depth=depth if depth < num_layers else None,
                computed=flags,
                layers=tuple(layers) if i == request.detail else (),
            )
        )
    return ReplyLens("raw", num_layers, STT_LAYERS, "strict", tuple(tokens))


def _load_program_file(path: Path) -> tuple[str, ...]:
    """Mimics the TTFA loader's errors for a program file: missing, not TOML, or no zones."""
    if not path.is_file():
        raise ProgramError(f"program file {path} does not exist", hint="pass a built-in name or a .toml path")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ProgramError(f"program file {path} is not valid TOML: {err}", hint="fix the TOML syntax") from None
    if not data.get("zones"):
        raise ProgramError(f"program file {path} declares no [[zones]]", hint="add at least one [[zones]] table")
    return tuple(data.get("tags", ()))
