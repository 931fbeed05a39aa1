"""Tools the model calls inline (the calculator, and any tool registered here), behind one interface and a registry.

Add a tool in one file: build a `Tool` (e.g. `FunctionTool("shout", fn, prefix="shout:", grammar=...)`) and call
`TOOLS.register(tool)` before the engine is built. A tool with a `prefix` shares the model's tool markers (every
chat format has one set): the engine dispatches a call that starts with the prefix to it, holds the call to the
tools' grammars, and the reply fold, transcript (titled by `Tool.describe`), history and batch records take it as
they take the calculator's. A tool may instead declare markers of its own; the engine dispatches those too, but
chat formats and the reply fold know only the model's markers, so its calls stay plain text in the content.
"""

from chatapp.tools.base import FunctionTool, Tool, ToolRegistry, ToolResult
from chatapp.tools.calculator import CALCULATOR, evaluate

TOOLS = ToolRegistry([CALCULATOR])

__all__ = ["CALCULATOR", "TOOLS", "FunctionTool", "Tool", "ToolRegistry", "ToolResult", "evaluate"]
