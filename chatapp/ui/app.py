"""The chat TUI: a transcript and an input on the left, the model's internals on the right.

The app owns no model: it drives a `ChatBackend` and consumes `Step` events. Generation runs in a thread worker
that hands batches to the UI (see `streaming`); every batch is saved to the history database before it is drawn,
so whatever was on screen survives a crash. Widgets each own one thing and talk through messages: the transcript
posts `TokenSelected`, the input posts `Submitted`, the worker posts `GenerationEnded`.

The app draws and takes keys before the backend's model is loaded (`startup`): a message sent meanwhile waits on
screen and goes when the model is ready; keys that need the model say it is still loading.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.widgets import Footer, Header, Static
from textual.worker import Worker, WorkerCancelled, WorkerFailed, get_current_worker

from chatapp.engine.events import Step, TokenEvent
from chatapp.engine.lens import LensRequest, ReplyLens
from chatapp.engine.reply import Reply
from chatapp.errors import ChatappError, HistoryError, user_message
from chatapp.settings import config_dir, data_dir, history_db_path
from chatapp.tools.parts import content_text
from chatapp.ui.backend import ChatBackend, StepStream
from chatapp.ui.commands import ChatCommands
from chatapp.ui.compare import Comparison
from chatapp.ui.export import export_conversation
from chatapp.ui.history import HistoryStore, answer_finished, open_history
from chatapp.ui.screens.compare import CompareScreen
from chatapp.ui.screens.help import WIDGET_KEYS, HelpFacts, HelpScreen, binding_keys
from chatapp.ui.screens.history import HistoryScreen, ResumeChoice
from chatapp.ui.screens.program import ProgramChoice, ProgramScreen
from chatapp.ui.screens.settings import SettingsChoice, SettingsScreen
from chatapp.ui.startup import EngineFailed, EngineReady
from chatapp.ui.streaming import BATCH_INTERVAL, FirstTokens, Generation, GenerationEnded, Outcome
from chatapp.ui.widgets.heatmap import RoutingHeatmap, skip_mode_caption
from chatapp.ui.widgets.panels import StatsPanel, TokenInspector, ZonePills
from chatapp.ui.widgets.probability import LEGEND
from chatapp.ui.widgets.prompt import PromptInput
from chatapp.ui.widgets.transcript import AssistantMessage, PendingMessage, TokenRun, Transcript, UserMessage

_TITLE_LENGTH = 48


@dataclass(frozen=True)
class _Panels:
    """The widgets every streamed batch updates, looked up once (a DOM query per batch adds up)."""

    transcript: Transcript
    heatmap: RoutingHeatmap
    zones: ZonePills
    stats: StatsPanel


class ChatApp(App[None]):
    """Chat with a model and watch it think."""

    CSS_PATH = ["app.tcss", "screens.tcss"]
    # Small terminals (app.tcss): the transcript and the input always keep the room; the side panels narrow, then
    # hide below 60 columns; below 16 rows the header and the lower side panels go.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (60, "-medium"), (110, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (16, "-tall")]
    TITLE = "chatapp"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+e", "edit_last", "Edit last", priority=True),
        Binding("f2", "settings", "Settings"),
        Binding("f3", "switch_program", "Program"),
        Binding("f4", "history", "History"),
        Binding("ctrl+s", "export", "Export", show=False),
        Binding("ctrl+y", "copy_answer", "Copy answer", show=False, priority=True),
        Binding("f1", "help", "Help"),
        Binding("f5", "compare", "Compare with routing off", show=False),
        Binding("f6", "toggle_probabilities", "Colour tokens by probability", show=False),
        Binding("f7", "toggle_lens", "Layer lens: what each layer made of the token", show=False, priority=True),
    ]
    probability_colours = False  # the transcript colours sampled tokens by probability (f6)
    lens_on = False  # the inspector shows the selected token's layers, the heatmap a depth row (f7)

    def __init__(
        self,
        backend: ChatBackend,
        store: HistoryStore,
        *,
        clock: Callable[[], float] = time.time,
        cursor_blink: bool | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend
        self.store = store
        self.clock = clock
        self.conversation_id: int | None = None
        self.generation: Generation | None = None
        self.editing = False
        self._worker: Worker[None] | None = None
        self._comparing = False  # a routing-off answer is being generated for the compare screen
        self._selected: tuple[AssistantMessage, int] | None = None  # the inspected token (answer, index)
        self._lens_shown: tuple[AssistantMessage, ReplyLens] | None = None  # whose depths the panels show
        self.loading = not backend.ready  # the backend's model is still loading (`_on_engine_ready` ends it)
        self._pending: PendingMessage | None = None  # the message sent while it loads
        # Why the model did not load: the app closes and whoever ran it reports this (the CLI prints it).
        self.engine_error: ChatappError | None = None
        self.unsent: str | None = None  # the message that was waiting for it, if any
        self.cursor_blink = self.animation_level != "none" if cursor_blink is None else cursor_blink
        self.sub_title = self._sub_title()

    # --- layout ---------------------------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        stt_layers = () if self.loading else self.backend.info.stt_layers  # given to the panels once loaded
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat"):
                with Transcript(id="transcript"):
                    yield Static(self._welcome(), id="welcome")
                yield PromptInput(self.store.recent_prompts(), id="prompt")
            with Vertical(id="side"):
                yield ZonePills(id="zones")
                yield RoutingHeatmap(stt_layers, id="heatmap")
                yield TokenInspector(stt_layers, id="inspector")
                yield StatsPanel(id="stats")
        yield Footer()

    def on_mount(self) -> None:
        if getattr(self.store, "notice", None):
            self.notify(self.store.notice, severity="warning", timeout=15)
        self.store.on_unsaved = self._history_unsaved
        if hasattr(self.store, "on_notice"):  # the history database was written again on its own (deleted under us)
            self.store.on_notice = lambda text: self.notify(text, title="History", severity="warning", timeout=15)
        if (unsaved := getattr(self.store, "unsaved", None)) is not None:  # it could not be written from the start
            self._history_unsaved(unsaved)
        self._panels = _Panels(
            self.query_one(Transcript),
            self.query_one(RoutingHeatmap),
            self.query_one(ZonePills),
            self.query_one(StatsPanel),
        )
        prompt = self.query_one(PromptInput)
        prompt.cursor_blink = self.cursor_blink
        prompt.border_title = "message · enter send · ctrl+j newline · esc stop"
        self.query_one(RoutingHeatmap).border_title = "routing · layers × tokens"
        self.query_one(ZonePills).set_program(self.backend.program)
        # Focused now, not by `focus()`'s later callback: keys typed while the app was starting are already queued
        # ahead of that callback, and with nothing focused they would be dropped.
        self.screen.set_focus(prompt)
        if self.loading:
            self._panels.heatmap.border_subtitle = "loading the model…"
            self._wait_for_engine()
        else:
            self._show_model()

    def _show_model(self) -> None:
        """What the panels show of the loaded model."""
        info = self.backend.info
        heatmap = self._panels.heatmap
        if not info.stt_layers:
            heatmap.border_subtitle = "model has no STT layers"
        else:
            heatmap.border_subtitle = skip_mode_caption(info.skip_mode, self._routing_level())

    def _routing_level(self) -> str:
        """The routing level answers run at: the settings' own, else the model's default."""
        return self.backend.settings.routing_level or self.backend.info.routing_levels[0]

    @property
    def model_name(self) -> str:
        """The model's name (its directory's), known before it is loaded."""
        return Path(self.backend.model_path).name

    def _welcome(self) -> Content:
        if self.loading:
            about = f" · {self.model_name} · loading the model…\n"
        else:
            info = self.backend.info
            about = f" · {info.name} on {info.device} · {info.num_layers} layers, {len(info.stt_layers)} STT\n"
        return Content.assemble(
            ("chatapp", "bold"),
            about,
            ("Type a message and press Enter. ", "dim"),
            ("F1", "bold $accent"),
            (" help · ", "dim"),
            ("ctrl+p", "bold $accent"),
            (" commands", "dim"),
        )

    def _sub_title(self) -> str:
        unsaved = " · history not saved" if getattr(self.store, "unsaved", None) is not None else ""
        if self.loading:
            return f"{self.model_name} · loading the model…{unsaved}"
        program = self.backend.program
        return f"{self.backend.info.name} · program: {program.name if program else 'none'}{unsaved}"

    def _history_unsaved(self, err: HistoryError) -> None:
        """The history database stopped taking writes: the conversation goes on in memory (the store's copy), and
        the user is told at once and, in the header, for as long as it lasts."""
        self.notify(user_message(err).text(), title="History not saved", severity="error", timeout=30)
        self.sub_title = self._sub_title()

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def is_generating(self) -> bool:
        return self.generation is not None or self._comparing

    # --- start-up ---------------------------------------------------------------------------------------------------
    @work(thread=True, exclusive=True, group="engine-start", exit_on_error=True)
    def _wait_for_engine(self) -> None:
        """Wait in this thread for the backend's model, then say it is ready or why it is not. It waits in short
        slices, so that quitting while the model loads is not held up by this thread."""
        worker = get_current_worker()
        try:
            while not self.backend.wait_ready(0.1):
                if worker.is_cancelled:
                    return
        except ChatappError as err:
            if not worker.is_cancelled:
                self.post_message(EngineFailed(err))
            return
        self.post_message(EngineReady())

    @on(EngineReady)
    def _on_engine_ready(self) -> None:
        """Show the model, and send the message that was waiting for it."""
        self.loading = False
        stt_layers = self.backend.info.stt_layers
        self._panels.heatmap.set_layers(stt_layers)
        self.query_one(TokenInspector).set_layers(stt_layers)
        self._show_model()
        for welcome in self.query("#welcome").results(Static):
            welcome.update(self._welcome())
        self.sub_title = self._sub_title()
        self.query_one(ZonePills).set_program(self.backend.program)
        if (pending := self._pending) is not None:
            self._pending = None
            pending.remove()
            self.send(pending.text)

    @on(EngineFailed)
    def _on_engine_failed(self, message: EngineFailed) -> None:
        """Nothing works without the model: close, leaving the error (and any message that was waiting) to whoever
        ran the app, which prints it once the terminal is its own again."""
        self.engine_error = message.error
        self.unsent = self._pending.text if self._pending is not None else None
        self.exit(return_code=1)

    def _still_loading(self) -> bool:
        """Keys that need the model say so while it loads (typing and sending do not wait for it)."""
        if self.loading:
            self.notify("The model is still loading: try again in a moment.", severity="warning")
        return self.loading

    def _still_answering(self) -> bool:
        """Keys that change the conversation or the settings wait for the answer to stop: say so while it runs."""
        if self.is_generating:
            self.notify("Still answering: press Esc to stop first.", severity="warning")
        return self.is_generating

    # --- sending --------------------------------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    def _on_submit(self, event: PromptInput.Submitted) -> None:
        if self.loading:
            self._wait_to_send(event.text)
            return
        if self._still_answering():
            event.prompt.set_text(event.text)
            return
        if self.editing:
            self._resend_edited(event.text)
        else:
            self.send(event.text)

    def _wait_to_send(self, text: str) -> None:
        """A message sent while the model loads is shown at once and sent when it is ready (one at a time, as
        while an answer streams)."""
        if self._pending is not None:
            self.notify("Still loading the model: your first message goes once it is ready.", severity="warning")
            self._give_back(text)
            return
        self._pending = PendingMessage(text)
        self.transcript.add(self._pending)

    def send(self, text: str) -> None:
        """Show and save the user's message, then stream the answer."""
        if (stream := self._open(lambda: self.backend.send(text))) is None:
            self._give_back(text)
            return
        self._ensure_conversation(text)
        self._start(stream, self._user_message(text))

    def _give_back(self, text: str) -> None:
        """Put a message that was not sent back in the input, ahead of anything typed since it was sent."""
        prompt = self.query_one(PromptInput)
        prompt.set_text(f"{text}\n{prompt.text}" if prompt.text.strip() else text)

    def _resend_edited(self, text: str) -> None:
        if (stream := self._open(lambda: self.backend.edit_last(text))) is None:
            self._give_back(text)
            return
        self.editing = False
        self.query_one(PromptInput).border_subtitle = ""
        self._drop_last_exchange()
        self._start(stream, self._user_message(text))

    def _open(self, open_stream: Callable[[], StepStream]) -> StepStream | None:
        """Start a backend call on the UI thread: it validates (context, settings) before anything is shown, and
        only iterating the stream does the work. A user-caused error is shown and nothing changes."""
        try:
            return open_stream()
        except ChatappError as err:
            self.notify(user_message(err).text(), title="Cannot answer", severity="error")
            return None

    def _ensure_conversation(self, first_message: str) -> None:
        if self.conversation_id is None:
            title = first_message.strip().splitlines()[0][:_TITLE_LENGTH]
            program = self.backend.program.name if self.backend.program else None
            self.conversation_id = self.store.create_conversation(title, model=self.backend.info.name, program=program)

    def _user_message(self, text: str) -> UserMessage:
        """Save the user's message; its widget is mounted together with the answer's (one layout pass, not two)."""
        assert self.conversation_id is not None
        self._remove_welcome()
        message_id = self.store.add_message(self.conversation_id, "user", text)
        return UserMessage(text, message_id=message_id)

    def _remove_welcome(self) -> None:
        for welcome in self.query("#welcome"):
            welcome.remove()

    def _new_reply(self) -> Reply:
        """The fold of the next answer (row 0 of the backend's stream)."""
        info = self.backend.info
        return Reply(0, info.num_layers, info.stt_layers, info.tool_markers, info.skip_cost)

    def _start(self, stream: StepStream, user: UserMessage | None = None) -> None:
        """Create the answer (on screen, after the user's message if given, and in the database) and generate it in
        a thread worker."""
        assert self.conversation_id is not None
        message_id = self.store.add_message(self.conversation_id, "assistant", "", status="streaming")
        reply = self._new_reply()
        answer = AssistantMessage(message_id=message_id, reply=reply)
        self.transcript.add(*([user] if user else []), answer)
        self.generation = Generation(answer, message_id, reply)
        self.query_one(RoutingHeatmap).start(self.backend.settings.max_tokens)
        self._lens_shown = None
        self.query_one(RoutingHeatmap).set_depths([] if self.lens_on else None)
        self.query_one(TokenInspector).show(None)
        self.query_one(StatsPanel).show(self.generation.reply)
        generation = self.generation
        generation.ticker = self.set_interval(BATCH_INTERVAL, lambda: self._take_batch(generation))
        self._worker = self._generate(generation, stream)

    @work(thread=True, exclusive=True, group="generation", exit_on_error=True)
    def _generate(self, generation: Generation, stream: StepStream) -> None:
        """Iterate the backend's stream in this thread into the answer's channel; cancel it as soon as the worker is
        cancelled."""
        worker = get_current_worker()
        outcome: Outcome = "complete"
        error: str | None = None
        first = True
        try:
            for step in stream:
                generation.channel.put(step)
                if first and step.tokens:
                    first = False
                    self.post_message(FirstTokens(generation))
                if worker.is_cancelled and outcome != "interrupted":
                    outcome = "interrupted"
                    # Keep reading: what a stream still yields after `cancel` belongs to the answer (an engine
                    # process has a few steps in flight); an in-process stream simply ends here.
                    self.backend.cancel(stream)
        except ChatappError as err:
            outcome, error = "error", user_message(err).one_line()
        finally:
            stream.close()  # a no-op once exhausted; frees the engine's batch otherwise
            self.post_message(GenerationEnded(generation, outcome, error))

    def _take_batch(self, generation: Generation) -> None:
        """Timer tick: draw whatever the worker has produced since the last tick."""
        if steps := generation.channel.take():
            self._apply(generation, steps)

    @on(FirstTokens)
    def _on_first_tokens(self, message: FirstTokens) -> None:
        self._take_batch(message.generation)

    @on(GenerationEnded)
    def _on_generation_ended(self, message: GenerationEnded) -> None:
        generation = message.generation
        if generation.ticker is not None:
            generation.ticker.stop()
        events = self._apply(generation, generation.channel.take(), final=True)
        last = events[-1] if events else None
        outcome, detail = message.outcome, message.error
        answer = generation.answer
        assert isinstance(answer, AssistantMessage)
        if last is None and answer.events:
            last = answer.events[-1]
        if last is not None and last.finish_reason == "error":
            outcome, detail = "error", last.error
        elif answer_finished(answer.events):
            # The answer ended by itself: an esc or an engine failure after its last token did not cut it short.
            if outcome == "error" and detail:
                self.notify(detail, title="After the answer", severity="error", timeout=15)
            outcome, detail = "complete", None
            if last is not None and last.finish_reason in ("length", "context"):
                detail = "stopped at max tokens" if last.finish_reason == "length" else "context is full"
        elif last is not None and last.finish_reason == "cancelled":
            outcome = "interrupted"
        # What the answer showed is what is stored: the one reply fold's content.
        self.store.finish_message(
            generation.message_id, "complete" if outcome == "complete" else "interrupted", generation.reply.content
        )
        if answer.is_attached:
            answer.set_status(outcome, detail)
        if self.generation is generation:
            self.generation = None
            if self.lens_on and answer.is_attached and answer.events:
                # Read the answer's layers now, while its text is being read: selecting a token then costs the
                # engine a few head products instead of a forward over the whole conversation.
                self._selected = self._selected if self._selected and self._selected[0] is answer else (answer, 0)
                self._read_lens()

    def _apply(self, generation: Generation, steps: list[Step], *, final: bool = False) -> list[TokenEvent]:
        """Save a batch, then draw it: transcript, heatmap, zone pills, stats. The stats text changes a few times a
        second while streaming; the last batch (`final`) settles the heatmap and shows the final figures."""
        answer = generation.answer
        assert isinstance(answer, AssistantMessage)
        reply = generation.reply
        for step in steps:
            reply.add_step(step)
        events = reply.events[generation.written :]
        generation.steps += len(steps)
        current = self.generation is generation
        if events:
            pieces, generation.pieces_written = reply.pieces_since(generation.pieces_written)
            self.store.append_tokens(generation.message_id, generation.written, events, pieces)
            generation.written += len(events)
            if answer.is_attached:
                transcript = self._panels.transcript
                at_bottom = transcript.is_at_bottom
                answer.show_new()
                transcript.follow_if(at_bottom)
            if current:
                self._panels.heatmap.extend(events)
                self._panels.zones.set_active(events[-1].tags, events[-1].zone)
        if current and final:
            self._panels.heatmap.settle()
            self._panels.stats.show(generation.reply)
        elif current and events:
            self._panels.stats.show_live(generation.reply)
        return events

    # --- token inspection -----------------------------------------------------------------------------------------
    @on(AssistantMessage.TokenSelected)
    def _on_token_selected(self, message: AssistantMessage.TokenSelected) -> None:
        self._selected = (message.answer, message.index)
        if not self.lens_on:
            self.query_one(TokenInspector).show(message.event, message.index)
        heatmap = self.query_one(RoutingHeatmap)
        if self.generation is None or self.generation.answer is not message.answer:
            heatmap.set_tokens(message.answer.events, selected=message.index)
            if self._lens_shown is not None and self._lens_shown[0] is message.answer:
                heatmap.set_depths(self._depths(self._lens_shown[1]), self._lens_shown[1].num_layers)
        else:
            heatmap.select(message.index)
        if self.lens_on:
            self._read_lens()

    # --- the layer lens -------------------------------------------------------------------------------------------
    def action_toggle_lens(self) -> None:
        """f7 (or a click on the inspector): the inspector shows what each layer made of the selected token, the
        heatmap a row of decision depths, the stats panel their split by routing; again: back to the token."""
        if self._still_loading():
            return
        self.lens_on = not self.lens_on
        inspector = self.query_one(TokenInspector)
        if self.lens_on:
            self._read_lens()
            return
        self._lens_shown = None
        self.query_one(RoutingHeatmap).set_depths(None)
        self.query_one(StatsPanel).show_lens(None)
        selected = self._selected
        if selected is not None and selected[0].is_attached and selected[1] < len(selected[0].events):
            inspector.show(selected[0].events[selected[1]], selected[1])
        else:
            inspector.show(None)

    def _read_lens(self) -> None:
        """Ask the engine for the selected token's layers (in a worker: a new answer costs the engine a replay of its
        tokens, up to a second at 1,000 tokens of context), unless an answer is streaming (the engine is busy)."""
        inspector = self.query_one(TokenInspector)
        selected = self._selected
        if selected is None or not selected[0].is_attached:
            inspector.show_lens(None, None, "select a token (click it, or shift+tab then ←/→) to see its layers")
            return
        answer, index = selected
        if self.is_generating:
            inspector.show_lens(None, None, "the layers are read once the answer is done")
            return
        answers = self.transcript.answers()
        events = answer.events
        request = LensRequest(
            answer=answers.index(answer),
            tokens=tuple(event.token for event in events),
            computed=tuple(event.computed for event in events),
            detail=index,
        )
        inspector.show_lens(None, None, "reading the layers…")
        self._lens_worker(answer, request)

    @work(thread=True, exclusive=True, group="lens", exit_on_error=False)
    def _lens_worker(self, answer: AssistantMessage, request: LensRequest) -> None:
        try:
            result = self.backend.lens(request)
        except ChatappError as err:
            self.call_from_thread(self.notify, str(err), title="Cannot read the layers", severity="error")
            return
        self.call_from_thread(self._show_lens, answer, request, result)

    def _show_lens(self, answer: AssistantMessage, request: LensRequest, result: ReplyLens) -> None:
        """Draw a lens that arrived, if it is still the one asked for."""
        if not self.lens_on or self._selected is None or self._selected[0] is not answer:
            return
        if self._selected[1] != request.detail:
            self._read_lens()  # the cursor moved on meanwhile: read the token now selected
            return
        self.query_one(TokenInspector).show_lens(result, request.detail)
        if self._lens_shown is None or self._lens_shown[0] is not answer:
            self._lens_shown = (answer, result)
            self.query_one(RoutingHeatmap).set_depths(self._depths(result), result.num_layers)
            self.query_one(StatsPanel).show_lens(result)

    @staticmethod
    def _depths(result: ReplyLens) -> list[int | None]:
        return [token.decision_depth for token in result.tokens]

    # --- actions --------------------------------------------------------------------------------------------------
    def action_stop(self) -> None:
        """Esc: stop the answer being generated, or leave edit mode."""
        if self._worker is not None and self.is_generating:
            self._worker.cancel()
        elif self.editing:
            self.editing = False
            prompt = self.query_one(PromptInput)
            prompt.border_subtitle = ""
            prompt.set_text("")

    async def _stop_and_wait(self) -> None:
        """Cancel a running generation and wait until its worker has finished with the backend."""
        worker = self._worker
        if worker is None or worker.is_finished:
            return
        worker.cancel()
        with contextlib.suppress(WorkerCancelled, WorkerFailed):
            await worker.wait()

    def _new_session(self, history: list[dict] | None = None) -> bool:
        """Start the backend's next conversation; a backend that cannot (its engine process has stopped) is reported
        and the screen is left as it is."""
        try:
            self.backend.new_session(history or [])
        except ChatappError as err:
            self.notify(
                user_message(err).text(), title="Cannot start the conversation", severity="error", timeout=15
            )
            return False
        return True

    async def action_new_chat(self) -> None:
        if self._still_loading():
            return
        await self._stop_and_wait()
        if not self._new_session():
            return
        self.conversation_id = None
        self.generation = None
        self.editing = False
        await self.transcript.remove_children()
        await self.transcript.mount(Static(self._welcome(), id="welcome"))
        self._reset_panels()
        self.query_one(PromptInput).focus()

    def _reset_panels(self) -> None:
        self._selected = self._lens_shown = None
        self.query_one(RoutingHeatmap).set_tokens([])
        self.query_one(RoutingHeatmap).set_depths([] if self.lens_on else None)
        self.query_one(TokenInspector).show(None)
        self.query_one(StatsPanel).show(Reply())
        self.query_one(ZonePills).set_program(self.backend.program)

    def _last_widget(self, kind: type) -> object | None:
        widgets = [w for w in self.transcript.children if isinstance(w, UserMessage | AssistantMessage)]
        return widgets[-1] if widgets and isinstance(widgets[-1], kind) else None

    def action_regenerate(self) -> None:
        if self._still_loading() or self._still_answering():
            return
        answer = self._last_widget(AssistantMessage)
        if not isinstance(answer, AssistantMessage):
            self.notify("Nothing to regenerate yet.", severity="warning")
            return
        if (stream := self._open(self.backend.regenerate)) is None:
            return
        self.store.delete_message(answer.message_id)
        answer.remove()
        self._start(stream)

    def action_edit_last(self) -> None:
        if self._still_answering():
            return
        users = list(self.transcript.query(UserMessage))
        if not users:
            self.notify("No message to edit yet.", severity="warning")
            return
        self.editing = True
        prompt = self.query_one(PromptInput)
        prompt.set_text(users[-1].text)
        prompt.border_subtitle = "editing last message · enter resend · esc cancel"
        prompt.focus()

    def _drop_last_exchange(self) -> None:
        """Remove the last user message and everything after it (its answer), on screen and in the database."""
        children = list(self.transcript.children)
        last_user = max(i for i, w in enumerate(children) if isinstance(w, UserMessage))
        for widget in children[last_user:]:
            if isinstance(widget, UserMessage | AssistantMessage):
                self.store.delete_message(widget.message_id)
            widget.remove()

    def action_settings(self) -> None:
        # The settings apply to the next answer; the engine is busy with this one.
        if self._still_loading() or self._still_answering():
            return

        def applied(choice: SettingsChoice | None) -> None:
            if choice is not None:
                self._show_model()  # the heatmap's caption names the routing level
                self.notify("Settings saved for the next answer.")

        self.push_screen(SettingsScreen(self.backend), applied)

    def action_switch_program(self) -> None:
        if self._still_loading() or self._still_answering():
            return

        def switched(choice: ProgramChoice | None) -> None:
            if choice is None:
                return
            self.query_one(ZonePills).set_program(choice.program)
            self.sub_title = self._sub_title()
            if self.conversation_id is not None:
                self.store.set_program(self.conversation_id, choice.program.name if choice.program else None)

        self.push_screen(ProgramScreen(self.backend), switched)

    def action_history(self) -> None:
        self.push_screen(HistoryScreen(self.store, current=self.conversation_id), self._resume)

    async def _resume(self, choice: ResumeChoice | None) -> None:
        if choice is None or self._still_loading():
            return
        await self._stop_and_wait()
        conversation = self.store.load(choice.conversation_id)
        if not self._new_session([m.chat_message() for m in conversation.messages]):
            return
        self.conversation_id = conversation.summary.id
        self.generation = None
        self.editing = False
        await self.transcript.remove_children()
        widgets: list[UserMessage | AssistantMessage] = []
        for stored in conversation.messages:
            if stored.role == "user":
                widgets.append(UserMessage(content_text(stored.content), message_id=stored.id))
            else:
                widgets.append(
                    AssistantMessage(
                        stored.tokens,
                        status=stored.status,
                        message_id=stored.id,
                        markers=self.backend.info.tool_markers,
                    )
                )
        await self.transcript.mount_all(widgets)
        self.transcript.scroll_end(animate=False, immediate=False)
        self._reset_panels()
        answers = [w for w in widgets if isinstance(w, AssistantMessage)]
        if answers:
            self.query_one(RoutingHeatmap).set_tokens(answers[-1].events)
        self.notify(f"Resumed “{conversation.summary.title}”.")

    def action_export(self) -> None:
        if self.conversation_id is None:
            self.notify("Nothing to export yet.", severity="warning")
            return
        try:
            markdown, data = export_conversation(
                self.store.load(self.conversation_id), data_dir() / "exports", now=self.clock()
            )
        except ChatappError as err:  # the conversation stays on screen and in the history: only the files failed
            self.notify(user_message(err).text(), title="Not exported", severity="error", timeout=15)
            return
        self.notify(f"Exported to {markdown} and {data.name}.")

    def action_copy_answer(self) -> None:
        answer = self._last_answer()
        if answer is None:
            self.notify("No answer to copy yet.", severity="warning")
            return
        self.copy_to_clipboard(content_text(answer.reply.content))
        self.notify("Copied the last answer.")

    def _last_answer(self) -> AssistantMessage | None:
        answers = self.transcript.answers()
        return answers[-1] if answers else None

    def action_toggle_probabilities(self) -> None:
        """f6: colour sampled tokens by their probability under the model (forced tokens keep their style)."""
        self.probability_colours = not self.probability_colours
        for run in self.transcript.query(TokenRun):
            run.refresh()  # the run sees the new flag in its render key and restyles its tokens
        shown = f"on · {LEGEND}" if self.probability_colours else "off"
        self.notify(f"Probability colours {shown}.")

    def action_compare(self) -> None:
        """f5: regenerate the last answer with STT routing off (same seed and settings) and show where it diverges."""
        if self._still_answering():
            return
        answer = self._last_answer()
        if answer is None or not answer.events:
            self.notify("No answer to compare yet.", severity="warning")
            return
        if (stream := self._open(self.backend.compare_last)) is None:
            return
        self._comparing = True
        self.notify("Answering again with routing off…")
        self._compare(tuple(answer.events), stream)

    @work(thread=True, exclusive=True, group="compare", exit_on_error=False)
    def _compare(self, routed: tuple[TokenEvent, ...], stream: StepStream) -> None:
        """Run the routing-off answer to its end in this thread, then show the comparison."""
        unrouted: list[TokenEvent] = []
        try:
            for step in stream:
                unrouted.extend(event for event in step.tokens if event.row == 0)
        except ChatappError as err:
            self.call_from_thread(self.notify, user_message(err).text(), title="Cannot compare", severity="error")
            return
        finally:
            stream.close()
            self.call_from_thread(setattr, self, "_comparing", False)
        self.call_from_thread(self.push_screen, CompareScreen(Comparison.of(routed, unrouted)))

    def action_help(self) -> None:
        facts = HelpFacts(
            keys=(*binding_keys(self.BINDINGS), ("ctrl+p", "command palette"), ("ctrl+q", "quit"), *WIDGET_KEYS),
            paths=(
                ("history database", str(self.store.path)),
                ("config", str(config_dir())),
                ("exports", str(data_dir() / "exports")),
                ("model", self.backend.model_path),
                *((("engine log", str(log)),) if (log := getattr(self.backend, "log_path", None)) else ()),
            ),
        )
        self.push_screen(HelpScreen(facts))

    def on_unmount(self) -> None:
        self.store.close()


def make_app(
    *,
    model_dir: str | Path | None = None,
    program: str | None = None,
    db_path: Path | None = None,
    device: str | None = None,
    backend: ChatBackend | None = None,
    in_process: bool = False,
    clock: Callable[[], float] = time.time,
    cursor_blink: bool | None = None,
    routing_level: str | None = None,
) -> ChatApp:
    """Build the chat app: load the model (unless a backend is given), the program and the history database.

    The model runs in its own engine process (`ProcessBackend`), so that the UI's drawing never competes with
    generation for the interpreter lock; `in_process` keeps it in this process (`EngineBackend`). Whoever runs the
    app closes `app.backend` afterwards (`close_backend`).

    The engine process loads the model (and switches to `program`) while the app already draws and takes keys: what
    stops it (`ModelDirError`, `ProgramError`) closes the app, which leaves it in `app.engine_error` for the CLI to
    report. With a loaded backend (given, or `in_process`), these errors are raised here, before any UI starts.
    """
    # The history first: a database that cannot be used is reported before seconds of model loading.
    store = open_history(Path(db_path) if db_path else history_db_path(), clock=clock, move_aside=db_path is None)
    try:
        if backend is None:
            if in_process:
                from chatapp.models import resolve_model
                from chatapp.ui.backend import EngineBackend

                backend = EngineBackend.load(resolve_model(model_dir), device=device)
                if routing_level is not None:
                    backend.set_routing_level(routing_level)
            else:
                from chatapp.ui.process import start_engine

                # Returns at once: the app's first frame does not wait for torch and the weights (~3 s).
                backend = start_engine(model_dir, device=device, program=program, routing_level=routing_level)
                program = None  # the engine process switches to it as it starts
    except BaseException:
        store.close()
        raise
    try:
        if program is not None:
            backend.switch_program(program)
    except BaseException:
        store.close()
        close_backend(backend)
        raise
    return ChatApp(backend, store, clock=clock, cursor_blink=cursor_blink)


def close_backend(backend: ChatBackend) -> None:
    """Stop a backend's engine process, if it has one (an in-process or scripted backend has nothing to stop)."""
    close = getattr(backend, "close", None)
    if close is not None:
        close()
