"""The tool interface the engine's tool state machine drives, and a registry so tools can be added later.

A tool is called by the model: it writes the tool's start marker, an expression, and the end marker; the engine
runs the tool and forces the result between the output markers. Markers are special-token *names* (resolved to
ids by whoever holds the tokenizer), so this package stays free of tokenizers and tensors. A tool never raises
on bad input: a refusal is a `ToolResult` with a reason the model and the user both get to see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from chatapp.errors import ToolError
from chatapp.special_tokens import OUTPUT_END, OUTPUT_START, PYTHON_END, PYTHON_START
from chatapp.tools.parts import PartType


@dataclass(frozen=True, slots=True)
class ToolMarkers:
    """The special tokens a chat format writes a tool call and its result with: the one tool protocol.

    The model writes `call_start` expression `call_end`; the engine runs the tool and forces the result and
    `output_end`. With `output_start` None the model's `call_end` also opens the output (SmolLM2's `<jupyter_code>`
    expr `<jupyter_output>` result `<jupyter_text>`: tokens the base model already knows); otherwise the engine
    forces `output_start` first (nanochat's four markers). Names, not ids: whoever holds the tokenizer resolves them.
    """

    call_start: str
    call_end: str
    output_start: str | None
    output_end: str

    @property
    def output_opener(self) -> str:
        """The token that opens the tool's output block."""
        return self.output_start or self.call_end

    def part_after(self, text: str) -> PartType | None:
        """The content part a marker token with this text starts (None: not one of these markers): the one mapping
        between markers and parts. The output opener wins: with markers whose call end also opens the output
        (SmolLM2's), that token starts the output."""
        if text == self.output_opener:
            return "python_output"
        if text == self.call_start:
            return "python"
        if text in (self.call_end, self.output_end):
            return "text"
        return None

    def wrap(self, part: PartType) -> tuple[str, str]:
        """The marker names a part of this type is written between (how a chat template sees a tool call)."""
        if part == "python":
            return self.call_start, self.call_end
        if part == "python_output":
            return self.output_start or "", self.output_end
        return "", ""

    def to_json(self) -> dict[str, str | None]:
        return {
            "call_start": self.call_start,
            "call_end": self.call_end,
            "output_start": self.output_start,
            "output_end": self.output_end,
        }


NANOCHAT_TOOL_MARKERS = ToolMarkers(PYTHON_START, PYTHON_END, OUTPUT_START, OUTPUT_END)
# The markers the default SmolLM2 model is trained with: its tokenizer's Jupyter tokens.
JUPYTER_TOOL_MARKERS = ToolMarkers("<jupyter_code>", "<jupyter_output>", None, "<jupyter_text>")


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool call produced: `text` when `ok`, otherwise the `reason` it refused."""

    ok: bool
    text: str | None
    reason: str | None

    @classmethod
    def success(cls, text: str) -> ToolResult:
        return cls(ok=True, text=text, reason=None)

    @classmethod
    def refusal(cls, reason: str) -> ToolResult:
        return cls(ok=False, text=None, reason=reason)


@runtime_checkable
class Tool(Protocol):
    """A tool the model can call inline. `run` must finish quickly in any thread and never raise.

    What a tool declares, and all a new tool needs (one file plus `TOOLS.register(tool)`):
    - its markers: its own four, or nanochat's (the default), which the engine maps to the chat format's tool markers;
    - `prefix`: with shared markers, the text a call of this tool starts with (`"echo:"`); the engine dispatches a
      call by it and runs the tool on the rest. One tool per marker set may have none: the default (the calculator);
    - `grammar`: the regex its calls are held to (None: unconstrained);
    - `describe`: how the transcript titles one of its calls.
    """

    @property
    def name(self) -> str: ...
    @property
    def start_marker(self) -> str: ...
    @property
    def end_marker(self) -> str: ...
    @property
    def output_start_marker(self) -> str: ...
    @property
    def output_end_marker(self) -> str: ...
    @property
    def prefix(self) -> str | None: ...
    @property
    def grammar(self) -> str | None: ...

    def run(self, expression: str) -> ToolResult: ...

    def describe(self, expression: str, output: str | None, refused: bool) -> str: ...


def describe_call(name: str, expression: str, output: str | None, refused: bool) -> str:
    """The transcript's title for a call: `name: expression`, then `= output` or a refusal mark."""
    if refused:
        return f"{name}: {expression}  ✗ refused"
    return f"{name}: {expression}" if output is None else f"{name}: {expression} = {output}"


@dataclass(frozen=True, slots=True)
class FunctionTool:
    """A `Tool` backed by a plain function; markers default to nanochat's python/output tokens.

    `grammar`: a regex (fully anchored, the `chatapp.trie` dialect) of the expressions the tool takes. A tool that
    has one gets its calls constrained by the engine: between the start and end markers the model can only write
    text the grammar allows, so it may still call with the wrong numbers but never with a malformed expression
    (a tool without one is called with whatever the model writes). `prefix`: see `Tool`; the grammar then applies
    to what follows the prefix."""

    name: str
    function: Callable[[str], ToolResult]
    start_marker: str = PYTHON_START
    end_marker: str = PYTHON_END
    output_start_marker: str = OUTPUT_START
    output_end_marker: str = OUTPUT_END
    grammar: str | None = None
    prefix: str | None = None

    def run(self, expression: str) -> ToolResult:
        return self.function(expression)

    def describe(self, expression: str, output: str | None, refused: bool) -> str:
        shown = expression.strip()
        if self.prefix is not None and shown.startswith(self.prefix):
            shown = shown[len(self.prefix) :].strip()
        return describe_call(self.name, shown, output, refused)


class ToolRegistry:
    """Tools by name and by marker: the engine dispatches a call by the start marker the model wrote and, among
    the tools sharing that marker, by the call's prefix."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._by_name: dict[str, Tool] = {}
        for tool in tools:
            self.register(tool)

    def register(self, tool: Tool) -> None:
        """Add a tool. Names must be unique, and so must (start marker, prefix) pairs, or a call would be
        ambiguous."""
        if tool.name in self._by_name:
            raise ToolError(f"a tool named {tool.name!r} is already registered", hint="give the tool another name")
        prefix = getattr(tool, "prefix", None)
        for other in self._by_name.values():
            if other.start_marker == tool.start_marker and getattr(other, "prefix", None) == prefix:
                raise ToolError(
                    f"start marker {tool.start_marker!r} is already used by another tool ({other.name!r})"
                    + (f" with the prefix {prefix!r}" if prefix else ""),
                    hint="give the new tool a prefix of its own (calls starting with it go to it), or its own markers",
                )
        self._by_name[tool.name] = tool

    def unregister(self, name: str) -> Tool:
        """Remove a tool (an engine built before keeps the tools it was built with)."""
        tool = self.get(name)
        del self._by_name[name]
        return tool

    def get(self, name: str) -> Tool:
        try:
            return self._by_name[name]
        except KeyError:
            raise ToolError(f"unknown tool {name!r}", hint=f"known tools: {', '.join(self.names)}") from None

    def by_start_marker(self, marker: str) -> Tool | None:
        """The default tool of a start marker (the one without a prefix), else the first that uses it."""
        tools = [tool for tool in self._by_name.values() if tool.start_marker == marker]
        return next((tool for tool in tools if getattr(tool, "prefix", None) is None), tools[0] if tools else None)

    def describe(self, name: str, expression: str, output: str | None, refused: bool) -> str:
        """A call's title by its tool's own renderer (a generic one for a tool not registered here)."""
        tool = self._by_name.get(name)
        describe = getattr(tool, "describe", None)
        if describe is None:
            return describe_call(name, expression, output, refused)
        return describe(expression, output, refused)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def __iter__(self) -> Iterator[Tool]:
        return iter(list(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)
