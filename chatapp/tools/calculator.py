"""The inline calculator: arithmetic and letter counting, evaluated from a whitelist of Python syntax.

nanochat `eval`s a character-filtered string under a SIGALRM timeout. Alarms only work on the main thread (the
TUI generates in worker threads, where the timeout silently never fires), and a character filter is a weak fence.
Here the expression is parsed with `ast` and only this grammar is evaluated:

    expr   := number | "-" expr | "+" expr | expr op expr | "(" expr ")" | string ".count(" string ")"
    op     := + - * / // %
    number := int or float literal          string := str literal

No names, calls, attributes, subscripts, `**` or string arithmetic. Work is bounded before it is done, so every
input finishes in well under a millisecond per node with no timer: the source length, AST node count and depth are
capped, an integer may not exceed `MAX_INT_BITS` bits (a product is refused *before* multiplying when the operands'
bit lengths add up past the cap), and a float must stay finite.

Result text (`format_number`) is what training data writes after `<|output_start|>`:
- integers print exactly: `37*45` -> `1665`;
- floats are rounded to 10 significant digits; an integral result prints without a decimal point (`0.2*50` ->
  `10`), otherwise trailing zeros are stripped (`7/2` -> `3.5`, `1/3` -> `0.3333333333`);
- plain positional notation for 1e-6 <= |x| < 1e16 (and 0); outside that range scientific notation with a bare
  exponent (`2.5e-07` -> `2.5e-7`, `1e20` stays `1e20`).
"""

from __future__ import annotations

import ast
import math
from decimal import Decimal

from chatapp.tools.base import FunctionTool, ToolResult

MAX_SOURCE_CHARS = 1000
MAX_NODES = 400
MAX_DEPTH = 100  # a left-nested sum of ~100 terms; recursion stays far below the interpreter limit
# About 616 decimal digits: far beyond real arithmetic, small enough that every operation takes microseconds (and
# well below Python's 4,300-digit int/str conversion limit). Set below what MAX_SOURCE_CHARS of digits can spell,
# so the cap is a real bound, not a hope.
MAX_INT_BITS = 2048
SIGNIFICANT_DIGITS = 10
# Positional notation for decimal exponents in this range (1e-6 <= |x| < 1e16 after rounding); scientific outside.
POSITIONAL_EXPONENTS = (-6, 15)

Number = int | float


class Refusal(Exception):
    """Internal: why an expression is refused; becomes `ToolResult.reason`."""


_OPERATORS: dict[type[ast.operator], str] = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
}
_NAMED_OPERATORS: dict[type[ast.AST], str] = {
    ast.Pow: "'**' (power)",
    ast.MatMult: "'@'",
    ast.LShift: "'<<'",
    ast.RShift: "'>>'",
    ast.BitAnd: "'&'",
    ast.BitOr: "'|'",
    ast.BitXor: "'^'",
    ast.Invert: "'~'",
    ast.Not: "'not'",
}


def evaluate(expression: str) -> ToolResult:
    """Evaluate a calculator expression; never raises, never evals."""
    if not isinstance(expression, str):
        return ToolResult.refusal(f"expression must be text, got {type(expression).__name__}")
    source = expression.strip()
    try:
        return ToolResult.success(format_number(_evaluate_source(source)))
    except Refusal as refusal:
        return ToolResult.refusal(str(refusal))


def _evaluate_source(source: str) -> Number:
    if not source:
        raise Refusal("empty expression")
    if len(source) > MAX_SOURCE_CHARS:
        raise Refusal(f"expression is {len(source)} characters long; the limit is {MAX_SOURCE_CHARS}")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError as err:
        raise Refusal(f"not a valid expression: {err.msg}") from None
    except (ValueError, RecursionError, MemoryError):  # null bytes (3.11), nesting too deep for the parser
        raise Refusal("not a valid expression") from None
    _check_size(tree)
    value = _eval(tree.body)
    if isinstance(value, str):
        raise Refusal("the result must be a number, not text")
    return value


def _check_size(tree: ast.AST) -> None:
    """Refuse trees too big or deep to evaluate cheaply (iterative: deep trees must not recurse here)."""
    count = 0
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise Refusal(f"expression is too long (more than {MAX_NODES} syntax nodes)")
        if depth > MAX_DEPTH:
            raise Refusal(f"expression is nested too deeply (more than {MAX_DEPTH} levels)")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _eval(node: ast.expr) -> Number | str:
    if isinstance(node, ast.Constant):
        return _literal(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _number(_eval(node.operand), "unary minus/plus")
        return _check_float(-operand if isinstance(node.op, ast.USub) else +operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        symbol = _OPERATORS[type(node.op)]
        left = _number(_eval(node.left), f"'{symbol}'")
        right = _number(_eval(node.right), f"'{symbol}'")
        return _binary(symbol, left, right)
    if isinstance(node, ast.Call):
        return _count(node)
    raise Refusal(_describe(node))


def _literal(value: object) -> Number | str:
    if type(value) is int:
        _check_int(value)
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise Refusal("number literal is too large")
        return value
    if type(value) is str:
        return value
    raise Refusal(f"{type(value).__name__} literals are not allowed ({value!r:.40})")


def _number(value: Number | str, where: str) -> Number:
    if isinstance(value, str):
        raise Refusal(f'text can only be used as "text".count("x"), not with {where}')
    return value


def _binary(symbol: str, left: Number, right: Number) -> Number:
    both_ints = type(left) is int and type(right) is int
    if symbol == "*" and both_ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
        raise Refusal(f"result would exceed {MAX_INT_BITS} bits (about {int(MAX_INT_BITS * 0.30103)} digits)")
    try:
        if symbol == "+":
            result = left + right
        elif symbol == "-":
            result = left - right
        elif symbol == "*":
            result = left * right
        elif symbol == "/":
            result = left / right
        elif symbol == "//":
            result = left // right
        else:
            result = left % right
    except ZeroDivisionError:
        raise Refusal("division by zero") from None
    except OverflowError:  # an int too large for a float, or a quotient too large for one
        raise Refusal("number too large for a decimal result") from None
    if type(result) is int:
        _check_int(result)
        return result
    return _check_float(result)


def _check_int(value: int) -> None:
    if value.bit_length() > MAX_INT_BITS:
        raise Refusal(f"number exceeds {MAX_INT_BITS} bits (about {int(MAX_INT_BITS * 0.30103)} digits)")


def _check_float(value: Number) -> Number:
    if type(value) is float and not math.isfinite(value):
        raise Refusal("result is too large (floating-point overflow)")
    return value


def _count(node: ast.Call) -> int:
    """`"text".count("x")`: literal receiver, one literal argument, nothing else."""
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr == "count"):
        raise Refusal(_describe(node))
    receiver = func.value
    if not (isinstance(receiver, ast.Constant) and type(receiver.value) is str):
        raise Refusal('.count() needs a quoted text before it, as in "strawberry".count("r")')
    if node.keywords or len(node.args) != 1:
        raise Refusal('.count() takes exactly one quoted text argument, as in "strawberry".count("r")')
    (argument,) = node.args
    if not (isinstance(argument, ast.Constant) and type(argument.value) is str):
        raise Refusal('.count() takes exactly one quoted text argument, as in "strawberry".count("r")')
    return receiver.value.count(argument.value)


def _describe(node: ast.AST) -> str:
    """A refusal reason naming the construct, e.g. "names are not allowed ('x')"."""
    op = getattr(node, "op", None)
    if op is not None and type(op) in _NAMED_OPERATORS:
        return f"{_NAMED_OPERATORS[type(op)]} is not allowed"
    if isinstance(node, ast.Name):
        return f"names are not allowed ({node.id!r})"
    if isinstance(node, ast.Call):
        return 'function calls are not allowed (only "text".count("x"))'
    if isinstance(node, ast.Attribute):
        return f"attribute access is not allowed ('.{node.attr}')"
    if isinstance(node, ast.JoinedStr):
        return "f-strings are not allowed"
    kind = type(node).__name__
    return f"{kind} expressions are not allowed"


def format_number(value: Number) -> str:
    """The result text training data uses (rule in the module docstring).

    Rounding happens in decimal text (`%.9e`), never by converting back to a float, which would overflow for values
    just under the float maximum.
    """
    if type(value) is int:
        return str(value)
    if not math.isfinite(value):
        raise ValueError(f"cannot format {value!r}: not a finite number")
    scientific = f"{value:.{SIGNIFICANT_DIGITS - 1}e}"  # e.g. "-1.234500000e+05": 10 significant digits
    mantissa, exponent_text = scientific.split("e")
    exponent = int(exponent_text)
    if Decimal(mantissa) == 0:
        return "0"
    if POSITIONAL_EXPONENTS[0] <= exponent <= POSITIONAL_EXPONENTS[1]:
        return _strip_fraction_zeros(format(Decimal(scientific), "f"))
    return f"{_strip_fraction_zeros(mantissa)}e{exponent}"


def _strip_fraction_zeros(text: str) -> str:
    return text.rstrip("0").rstrip(".") if "." in text else text


# What a call may spell (the engine constrains the model's calls to it, see `FunctionTool.grammar`): arithmetic
# over digits, operators, parentheses and spaces, or a quoted string's `.count(...)` of another. Looser than the
# evaluator (it does not balance parentheses), so it never blocks an expression the calculator would take, and
# tighter than text: no words, no `=`, no answer written inside the call.
CALCULATOR_GRAMMAR = (
    r"[0-9(.+\-][0-9+\-*/%(). ]*"
    r"""|"[^"\n]*"\.count\("[^"\n]*"\)"""
    r"""|'[^'\n]*'\.count\('[^'\n]*'\)"""
)

CALCULATOR = FunctionTool(name="calculator", function=evaluate, grammar=CALCULATOR_GRAMMAR)
