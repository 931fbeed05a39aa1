"""A multi-turn chat that keeps its KV cache between turns and prefills only what is new.

nanochat's chat CLI re-prefills the whole conversation every turn and has no context guard. A `ChatSession`
keeps one single-row cache for the whole conversation:

- The cache holds the conversation exactly as the model saw it: the rendered prompt segments and the tokens the
  model itself produced (not a re-tokenization of the reply's text, which BPE may split differently). A turn
  feeds only its new segment: the assistant-turn closing the last reply lacks (e.g. `<|assistant_end|>` after a
  reply cut by max_tokens), the new user turn and `<|assistant_start|>`. So a turn's output is what a fresh
  prefill of `session.token_ids` would give.
- Before a turn's segment is fed the cache is marked (`cache.mark()`), so `regenerate` and `edit_last` roll back
  with `cache.restore()` instead of starting over.
- Cancel = the consumer closes the turn's generator (or simply starts another turn, which closes it): the partial
  answer is kept in `messages`, and since every reported token was fed before it was reported, the cache matches.

Context policy (from the turn's settings): "error" raises ContextOverflowError before a turn whose prompt leaves no
room to answer (a reply that later fills the context ends with finish reason "context"); "drop_oldest" drops the
oldest exchanges (keeping the system message) until the prompt plus `max_tokens` fits, then re-prefills once.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from chatapp.engine.events import Step
from chatapp.engine.protocols import ChatFormatLike, KVCacheLike, ModelLike
from chatapp.engine.reply import Reply
from chatapp.errors import ContextOverflowError, ConversationError
from chatapp.settings import GenerationSettings

if TYPE_CHECKING:
    from chatapp.trie.constraint import Constraint
    from chatapp.ttfa import Program

INITIAL_CACHE = 512  # slots allocated at the start of a conversation; the cache grows on demand


@dataclass(frozen=True)
class TurnRequest:
    """One row's validated request (settings, compiled program, compiled constraint), from `Engine.turn_request`."""

    settings: GenerationSettings
    program: Program | None = None
    constraint: Constraint | None = None  # in its start state


class TurnEngine(Protocol):
    """What a session needs from the engine (`chatapp.engine.engine.Engine`), which creates sessions: the session
    module stays below the engine module."""

    model: ModelLike
    chat_format: ChatFormatLike
    context_size: int

    def turn_request(
        self, settings: GenerationSettings, *, program: Program | None = None, constraint: Any = None
    ) -> TurnRequest: ...

    def continue_turn(self, cache: KVCacheLike, seen: int, segment: list[int], request: TurnRequest) -> Iterator[Step]: ...

    def new_reply(self, row: int = 0) -> Reply: ...


@dataclass
class _TurnStart:
    """Where the last turn began: enough to roll the conversation back to just before its user segment."""

    mark: Any  # the cache's CacheMark taken before the segment was fed (None: the cache was empty)
    token_count: int  # len(token_ids) at that moment
    message_count: int  # len(messages) before the user message


class ChatSession:
    """One conversation with the model; see the module docstring. Create with `engine.session(system)`."""

    def __init__(self, engine: TurnEngine, system: str | None = None) -> None:
        self.engine = engine
        self.system = system
        self.messages: list[dict[str, Any]] = []
        self._ids: list[int] = []
        self._cache: KVCacheLike | None = None
        self._last: _TurnStart | None = None
        self._active: Generator[Step, None, None] | None = None
        self.reset()

    # ------------------------------------------------------------------------------------------------- state
    @property
    def token_ids(self) -> tuple[int, ...]:
        """The conversation's tokens as the model saw and produced them (everything in the cache)."""
        return tuple(self._ids)

    @property
    def cache(self) -> KVCacheLike | None:
        """The conversation's KV cache (None before the first turn), for readers that replay tokens against it (the
        layer lens, `engine.lens_pass`); only turns write it."""
        return self._cache

    @property
    def context_used(self) -> int:
        return len(self._ids)

    @property
    def context_size(self) -> int:
        return self.engine.context_size

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and the cache."""
        self._close_active()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self._ids = []
        self._cache = None
        self._last = None

    # ------------------------------------------------------------------------------------------------- turns
    def send(
        self, text: str, settings: GenerationSettings, program: Program | None = None, constraint: str | Constraint | None = None
    ) -> Iterator[Step]:
        """Add a user message and stream the answer. Errors (context, bad settings) raise here, not mid-stream."""
        self._close_active()
        with torch.inference_mode():
            mark = self._cache.mark() if self._ids else None
        base = _TurnStart(mark, len(self._ids), len(self.messages))
        return self._start_turn({"role": "user", "content": text}, settings, base, program, constraint)

    def regenerate(self, settings: GenerationSettings, program: Program | None = None, constraint: str | Constraint | None = None) -> Iterator[Step]:
        """Drop the last answer and answer the last user message again."""
        self._close_active()
        base = self._last_turn()
        return self._start_turn(self.messages[base.message_count], settings, base, program, constraint)

    def edit_last(
        self, text: str, settings: GenerationSettings, program: Program | None = None, constraint: str | Constraint | None = None
    ) -> Iterator[Step]:
        """Replace the last user message with `text` and answer it."""
        self._close_active()
        return self._start_turn({"role": "user", "content": text}, settings, self._last_turn(), program, constraint)

    def _close_active(self) -> None:
        """Finish the previous turn's stream if its consumer left it open: the partial answer is recorded now,
        before the next turn is planned, rather than whenever the abandoned generator is collected."""
        active, self._active = self._active, None
        if active is not None:
            active.close()

    def _last_turn(self) -> _TurnStart:
        """Where the last exchange starts. For messages this session did not generate (a conversation restored
        from history) there is no cache mark: the turn is then prefilled afresh from the rendered messages."""
        if self._last is not None:
            return self._last
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        if not users:
            raise ConversationError("there is no turn to regenerate or edit", hint="send a message first")
        return _TurnStart(mark=None, token_count=0, message_count=users[-1])

    def _start_turn(
        self, user: dict[str, Any], settings: GenerationSettings, base: _TurnStart, program: Program | None, constraint: str | Constraint | None
    ) -> Iterator[Step]:
        """Plan the turn on top of `base` (the conversation up to before a user message) and validate it now, so
        errors raise at the call; the returned generator runs it."""
        prior = self.messages[: base.message_count]
        messages = [*prior, user]
        segment, fresh = self._segment(prior, self._ids[: base.token_count], messages)
        used = 0 if fresh else base.token_count
        if settings.context_policy == "drop_oldest" and used + len(segment) + settings.max_tokens >= self.context_size:
            messages = self._drop_oldest(messages, settings.max_tokens)
            segment, fresh, used = self.engine.chat_format.render_for_completion(messages), True, 0
        if used + len(segment) >= self.context_size:
            raise ContextOverflowError(
                f"this turn needs {used + len(segment)} tokens of context but the model holds {self.context_size}",
                hint="start a new conversation (ctrl+n in the chat) or send a shorter message",
            )
        request = self.engine.turn_request(settings, program=program, constraint=constraint)
        self._active = self._run_turn(base, messages, segment, fresh, request)
        return self._active

    def _run_turn(
        self,
        base: _TurnStart,
        messages: list[dict[str, Any]],
        segment: list[int],
        fresh: bool,
        request: TurnRequest,
    ) -> Generator[Step, None, None]:
        """Roll back to `base`, feed the segment, stream the answer, and record it (also when the consumer stops
        early). Nothing changes until the consumer asks for the first step, so a turn that is never started
        leaves the session as it was."""
        engine = self.engine
        with torch.inference_mode():  # the engine fills the cache in inference mode; edit it in the same mode
            if fresh or base.mark is None or self._cache is None:
                self._ids = []
                self._cache = engine.model.new_cache(1, min(self.context_size, INITIAL_CACHE))
            else:
                del self._ids[base.token_count :]
                self._cache.restore(base.mark)
            needed = min(self.context_size, len(self._ids) + len(segment) + request.settings.max_tokens)
            if needed > self._cache.max_len:
                self._cache.grow(needed)
            mark = self._cache.mark() if self._ids else None
        self._last = _TurnStart(mark, len(self._ids), len(messages) - 1)
        self.messages = messages
        steps = engine.continue_turn(self._cache, len(self._ids), segment, request)
        self._ids.extend(segment)
        reply = engine.new_reply()
        try:
            for step in steps:
                reply.add_step(step)
                yield step
        finally:
            steps.close()
            self._ids.extend(event.token for event in reply.events)  # the stop token too: the model saw it
            self.messages.append({"role": "assistant", "content": reply.content})

    # ------------------------------------------------------------------------------------------------ render
    def _segment(
        self, prior: list[dict[str, Any]], prior_ids: list[int], messages: list[dict[str, Any]]
    ) -> tuple[list[int], bool]:
        """The tokens to feed for a new user turn on top of `prior_ids`, and whether they start afresh (True).

        The conversation so far is rendered; the new prompt must extend it (true of nanochat's format and of
        templates that only append). What the rendered conversation has after the last `<|assistant_end|>` (the
        closing of the last reply) is fed too, minus the end token itself when the model already produced it.
        Otherwise (no cache yet, or a template that rewrites earlier turns) the whole prompt is fed afresh.
        """
        chat = self.engine.chat_format
        prompt = chat.render_for_completion(messages)
        if not prior_ids or prior[-1]["role"] != "assistant":
            return prompt, True
        before, _ = chat.render_conversation(prior)
        end = chat.assistant_end_id
        if prompt[: len(before)] != before or end is None or end not in before:
            return prompt, True
        closing = before[len(before) - before[::-1].index(end) - 1 :]
        if prior_ids[-1] == end:
            closing = closing[1:]
        return closing + prompt[len(before) :], False

    def _drop_oldest(self, messages: list[dict[str, Any]], max_tokens: int) -> list[dict[str, Any]]:
        """Drop whole user/assistant exchanges from the start until the prompt plus `max_tokens` fits."""
        chat = self.engine.chat_format
        head = messages[:1] if messages[0]["role"] == "system" else []
        body = messages[len(head) :]
        while len(body) > 1 and len(chat.render_for_completion([*head, *body])) + max_tokens >= self.context_size:
            body = body[2:]
        return [*head, *body]
