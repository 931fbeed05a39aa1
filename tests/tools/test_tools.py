"""The tool interface and registry."""

from __future__ import annotations

import pytest

from chatapp.errors import ToolError
from chatapp.tools import CALCULATOR, TOOLS, FunctionTool, Tool, ToolRegistry, ToolResult


def test_calculator_is_a_tool_with_nanochat_markers():
    assert isinstance(CALCULATOR, Tool)
    assert (CALCULATOR.start_marker, CALCULATOR.end_marker) == ("<|python_start|>", "<|python_end|>")
    assert (CALCULATOR.output_start_marker, CALCULATOR.output_end_marker) == ("<|output_start|>", "<|output_end|>")
    assert CALCULATOR.run("37*45") == ToolResult(ok=True, text="1665", reason=None)
    assert CALCULATOR.run("1/0") == ToolResult(ok=False, text=None, reason="division by zero")


def test_default_registry_finds_the_calculator_by_name_and_marker():
    assert TOOLS.names == ["calculator"]
    assert TOOLS.get("calculator") is CALCULATOR
    assert TOOLS.by_start_marker("<|python_start|>") is CALCULATOR
    assert TOOLS.by_start_marker("<|search_start|>") is None


def test_registry_accepts_new_tools_and_refuses_ambiguous_ones():
    echo = FunctionTool("echo", ToolResult.success, start_marker="<|echo_start|>", end_marker="<|echo_end|>")
    registry = ToolRegistry([CALCULATOR, echo])
    assert len(registry) == 2 and list(registry) == [CALCULATOR, echo]
    assert registry.by_start_marker("<|echo_start|>").run("hi") == ToolResult.success("hi")
    with pytest.raises(ToolError, match="already registered"):
        registry.register(FunctionTool("echo", ToolResult.success, start_marker="<|other|>"))
    with pytest.raises(ToolError, match="already used"):
        registry.register(FunctionTool("calc2", ToolResult.success))
    with pytest.raises(ToolError, match="unknown tool 'nope'") as info:
        registry.get("nope")
    assert "calculator, echo" in info.value.hint
