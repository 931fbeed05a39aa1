"""The per-row tool state machine: `<|python_start|>` expr `<|python_end|>` -> tool -> forced output block.

Follows nanochat's machine (docs/engine.md §6) with the gaps closed:

- A refusal is shown, not swallowed: nanochat forces nothing when the calculator returns None, so the model
  continues as if it had an answer. Here the output block is always forced; it holds the result, or
  `error: <reason>` for a refusal, and the row's ToolEvent says which (`result` / `refusal`).
- A call that never closes is bounded: after `max_expression_tokens` expression tokens the machine forces
  `<|python_end|>` itself and then a refusal block, so a looping model cannot grow an expression forever.
- A row that ends inside a call (stop token, max_tokens, full context) gets a `refusal` ToolEvent on its last
  token saying so; nothing is forced after the row ended.
- A tool with a grammar (`FunctionTool.grammar`, the calculator's) constrains its calls: while a call is open the
  row's `grammar` is a fresh `chatapp.trie` Constraint of it, ending at the call's end marker, and the loop masks
  and fast-forwards by it as by a request's own constraint. The model still chooses the expression; it cannot
  write one the tool would reject as malformed (`"word"count("x")` without its dot, an answer inside the call).

Forced tokens wait in a per-row host queue (`collections.deque`). Tool calls are rare, so a host structure is
cheaper than device bookkeeping; the engine's hot path only checks whether any row has a non-empty queue. Each
queued token carries the ToolEvent it announces (the call on a forced `<|python_end|>`, the result or refusal on
`<|output_start|>`), so the events reach the consumer with the token they belong to.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from chatapp.engine.constraints import fresh_constraint
from chatapp.engine.events import ToolEvent
from chatapp.errors import ChatappError
from chatapp.tools import Tool
from chatapp.tools.base import NANOCHAT_TOOL_MARKERS, ToolMarkers

DEFAULT_MAX_EXPRESSION_TOKENS = 64


@dataclass(frozen=True, slots=True)
class BoundTool:
    """The tools sharing one start marker, with the markers resolved to this tokenizer's ids. A call goes to the
    tool whose `prefix` it starts with, else to the one without a prefix (`Tool` explains prefixes)."""

    tools: tuple[Tool, ...]
    start_id: int
    end_id: int
    output_start_id: int | None  # None: the call's end marker also opens the output (nothing forced for it)
    output_end_id: int

    @property
    def tool(self) -> Tool:
        """The default tool (no prefix), else the first."""
        return next((t for t in self.tools if _prefix(t) is None), self.tools[0])

    def pick(self, expression: str) -> tuple[Tool, str] | None:
        """The tool a call's expression is for and what it runs on (the expression without the prefix); None when
        no tool takes it (prefixed tools only, and none matches)."""
        stripped = expression.strip()
        for tool in self.tools:
            prefix = _prefix(tool)
            if prefix is not None and stripped.startswith(prefix):
                return tool, stripped[len(prefix) :].strip()
        default = next((t for t in self.tools if _prefix(t) is None), None)
        return None if default is None else (default, stripped)

    @property
    def grammar(self) -> str | None:
        """The regex a call's expression must match: the default tool's grammar or a prefix and its tool's grammar
        (None when any of the tools takes anything)."""
        if len(self.tools) == 1 and _prefix(self.tools[0]) is None:
            return getattr(self.tools[0], "grammar", None)
        choices = []
        for tool in self.tools:
            grammar = getattr(tool, "grammar", None)
            if grammar is None:
                return None
            prefix = _prefix(tool)
            choices.append(f"({grammar})" if prefix is None else f"{_escape(prefix)} ?({grammar})")
        return "|".join(choices)


def _prefix(tool: Tool) -> str | None:
    return getattr(tool, "prefix", None)


def _escape(text: str) -> str:
    """`text` as a literal in a `chatapp.trie` regex."""
    return "".join(f"\\{c}" if c in r".^$*+?()[]{}|\-/" else c for c in text)


@dataclass(frozen=True, slots=True)
class ForcedToken:
    """A queued forced token and the ToolEvent (if any) that arrives with it."""

    token: int
    event: ToolEvent | None = None


class ToolBox:
    """The tools a model can call, resolved against its tokenizer, and how to turn text into tokens and back.

    Tools whose markers are not single tokens of the vocabulary are left out: the model cannot call them.
    """

    def __init__(
        self,
        tools: Iterable[Tool],
        token_id: Callable[[str], int | None],
        encode_text: Callable[[str], list[int]],
        decode: Callable[[Sequence[int]], str],
        max_expression_tokens: int = DEFAULT_MAX_EXPRESSION_TOKENS,
        markers: ToolMarkers | None = None,
        grammar: Callable[[str, int], Any] | None = None,
    ) -> None:
        """`markers`: the chat format's tool protocol. A tool written for nanochat's markers (the default of
        `FunctionTool` and the calculator) speaks the format's markers instead; a tool with markers of its own keeps
        them. `grammar(pattern, end_id)` builds a Constraint for a tool's grammar (None: calls are not
        constrained); it is called once per tool, on its first call."""
        self.by_start: dict[int, BoundTool] = {}
        for tool in tools:
            names = (tool.start_marker, tool.end_marker, tool.output_start_marker, tool.output_end_marker)
            if markers is not None and tool.start_marker == NANOCHAT_TOOL_MARKERS.call_start:
                names = (markers.call_start, markers.call_end, markers.output_start, markers.output_end)
            ids = [None if name is None else token_id(name) for name in names]
            start, end, out_start, out_end = ids
            if (
                start is not None
                and end is not None
                and out_end is not None
                and (out_start is not None or names[2] is None)
            ):
                shared = self.by_start.get(start)
                self.by_start[start] = BoundTool(
                    (*(shared.tools if shared else ()), tool), start, end, out_start, out_end
                )
        self.encode_text = encode_text
        self.decode = decode
        self.max_expression_tokens = max_expression_tokens
        self._build_grammar = grammar
        self._grammars: dict[int, Any] = {}  # start id -> the compiled grammar, copied for each call

    def __bool__(self) -> bool:
        return bool(self.by_start)

    @property
    def has_grammars(self) -> bool:
        """Whether any call will be constrained (a grammar builder and a tool with a grammar)."""
        return self._build_grammar is not None and any(c.grammar is not None for c in self.by_start.values())

    def call_grammar(self, call: BoundTool) -> Any | None:
        """A fresh Constraint for one call of `call`'s tool, or None when calls of it are not constrained."""
        if self._build_grammar is None or call.grammar is None:
            return None
        compiled = self._grammars.get(call.start_id)
        if compiled is None:
            compiled = self._grammars[call.start_id] = self._build_grammar(call.grammar, call.end_id)
        return fresh_constraint(compiled, self._build_grammar)


class ToolMachine:
    """One row's tool-call state: idle, or collecting an expression; plus the queue of forced tokens."""

    def __init__(self, box: ToolBox) -> None:
        self._box = box
        self._call: BoundTool | None = None
        self._expression: list[int] = []
        self.queue: deque[ForcedToken] = deque()
        self.grammar: Any | None = None  # the open call's Constraint (see the module docstring)

    def observe(self, token: int) -> ToolEvent | None:
        """Advance on a token the model sampled; returns the ToolEvent this token carries (the `call` event on
        the model's own `<|python_end|>`). Forced tokens are not observed: they come from `queue`."""
        call = self._call
        if call is None:
            self._call = self._box.by_start.get(token)
            self._expression = []
            self.grammar = None if self._call is None else self._box.call_grammar(self._call)
            return None
        if token == call.end_id:
            return self._close(call, forced_end=False)
        self._expression.append(token)
        if self.grammar is not None:
            try:
                self.grammar.consume(token)
            except ChatappError:  # a program fed the call a token outside the grammar: the call goes on unconstrained
                self.grammar = None
        if len(self._expression) >= self._box.max_expression_tokens:
            self._close(call, forced_end=True)
        return None

    def interrupt(self, why: str) -> ToolEvent | None:
        """The row ended (stop token, max_tokens, full context): a refusal event if a call was open."""
        call = self._call
        if call is None:
            return None
        self._call = self.grammar = None
        expression = self._expression_text()
        picked = call.pick(expression)
        name = call.tool.name if picked is None else picked[0].name
        return ToolEvent("refusal", name, expression, f"unfinished call: {why}")

    def _expression_text(self) -> str:
        return self._box.decode(self._expression)

    def _close(self, call: BoundTool, *, forced_end: bool) -> ToolEvent | None:
        """Run the tool and queue the output block; with `forced_end`, queue the closing marker first."""
        self._call = self.grammar = None
        expression = self._expression_text()
        picked = call.pick(expression)
        name = call.tool.name if picked is None else picked[0].name
        call_event = ToolEvent("call", name, expression)
        if forced_end:
            limit = self._box.max_expression_tokens
            outcome = ToolEvent("refusal", name, expression, f"expression longer than {limit} tokens")
            self.queue.append(ForcedToken(call.end_id, call_event))
        elif picked is None:
            known = ", ".join(repr(_prefix(t)) for t in call.tools)
            outcome = ToolEvent("refusal", name, expression, f"no tool takes this call (start it with {known})")
        else:
            tool, argument = picked
            result = tool.run(argument)
            outcome = (
                ToolEvent("result", name, expression, result.text)
                if result.ok
                else ToolEvent("refusal", name, expression, result.reason)
            )
        shown = outcome.output if outcome.kind == "result" else f"error: {outcome.output}"
        block = [*self._box.encode_text(shown or ""), call.output_end_id]
        if call.output_start_id is not None:
            block.insert(0, call.output_start_id)
        # The outcome event travels with the first forced token of the output block.
        self.queue.append(ForcedToken(block[0], outcome))
        self.queue.extend(ForcedToken(t) for t in block[1:])
        return None if forced_end else call_event
