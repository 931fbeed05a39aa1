"""Tools the model calls inline (today: the calculator), behind one interface and a registry.

Add a tool by building a `Tool` (e.g. a `FunctionTool`) with its own start marker and calling
`TOOLS.register(tool)`; the engine finds it by the marker the model writes.
"""

from chatapp.tools.base import FunctionTool, Tool, ToolRegistry, ToolResult
from chatapp.tools.calculator import CALCULATOR, evaluate

TOOLS = ToolRegistry([CALCULATOR])

__all__ = ["CALCULATOR", "TOOLS", "FunctionTool", "Tool", "ToolRegistry", "ToolResult", "evaluate"]
