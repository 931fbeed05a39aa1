"""The calculator against Python's own arithmetic, hostile inputs, number formatting and threads."""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.tools.calculator import (
    MAX_INT_BITS,
    MAX_SOURCE_CHARS,
    POSITIONAL_EXPONENTS,
    SIGNIFICANT_DIGITS,
    evaluate,
    format_number,
)


@pytest.mark.parametrize(
    ("expression", "text"),
    [
        ("37*45", "1665"),
        ("0.2*50", "10"),
        ("7/2", "3.5"),
        ('"strawberry".count("r")', "3"),
        ("  1 + 2 * 3  ", "7"),
        ("(1 + 2) * 3", "9"),
        ("-7 // 2", "-4"),
        ("-7 % 3", "2"),
        ("1/3", "0.3333333333"),
        ("2/3", "0.6666666667"),
        ("0.1 + 0.2", "0.3"),
        ("-0.0", "0"),
        ("+5", "5"),
        ("1e20", "1e20"),
        ("1/4e7", "2.5e-8"),
        ("0.000001", "0.000001"),
        ("123456789.123", "123456789.1"),
        ("12345678901234567", "12345678901234567"),
        ("12345678901234567.0", "1.23456789e16"),
        ('"banana".count("an")', "2"),
        ('"abc".count("")', "4"),
        ('"naïve café".count("é")', "1"),
        ("'Mississippi'.count('s') * 2", "8"),
        ("9" * 600, "9" * 600),
    ],
)
def test_examples(expression: str, text: str):
    assert evaluate(expression).text == text
    assert evaluate(expression).ok


# --- property test against Python --------------------------------------------------------------------------------

_numbers = st.one_of(
    st.integers(min_value=0, max_value=10**6).map(str),
    st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False).map(repr),
    st.builds(
        lambda text, sub: f"{text!r}.count({sub!r})",
        st.text(alphabet="abrsty ", max_size=12),
        st.text(alphabet="abrsty", min_size=1, max_size=2),
    ),
)


def _combine(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    binary = st.builds(
        lambda a, op, b: f"({a} {op} {b})", children, st.sampled_from(["+", "-", "*", "/", "//", "%"]), children
    )
    unary = st.builds(lambda sign, a: f"{sign}{a}", st.sampled_from(["-", "+"]), children)
    return binary | unary


expressions = st.recursive(_numbers, _combine, max_leaves=10)


def _python(expression: str) -> int | float | type[BaseException]:
    """The oracle: CPython evaluating the same (generated, known-safe) text."""
    try:
        return eval(expression, {"__builtins__": {}}, {})
    except (ZeroDivisionError, OverflowError) as err:
        return type(err)


@given(expressions)
@settings(max_examples=300)
def test_matches_python_arithmetic(expression: str):
    expected = _python(expression)
    result = evaluate(expression)
    if expected is ZeroDivisionError:
        assert (result.ok, result.reason) == (False, "division by zero")
    elif (isinstance(expected, float) and not math.isfinite(expected)) or expected is OverflowError:
        assert not result.ok
    elif type(expected) is int:
        assert result.text == str(expected)
    else:
        assert result.ok
        assert float(result.text) == float(f"{expected:.{SIGNIFICANT_DIGITS}g}")
        _assert_formatted(expected, result.text)


@given(st.floats(allow_nan=False, allow_infinity=False))
def test_format_number_rule(value: float):
    text = format_number(value)
    assert float(text) == float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    _assert_formatted(value, text)


def _assert_formatted(value: float, text: str) -> None:
    exponent = int(f"{value:.{SIGNIFICANT_DIGITS - 1}e}".split("e")[1])
    rounded = float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    positional = rounded == 0 or POSITIONAL_EXPONENTS[0] <= exponent <= POSITIONAL_EXPONENTS[1]
    assert ("e" in text) is not positional
    mantissa = text.split("e")[0]
    assert not mantissa.endswith(".0") and not ("." in mantissa and mantissa.endswith("0"))
    assert "+" not in text and "e-0" not in text
    if positional and rounded.is_integer():
        assert text == str(int(rounded))


def test_format_number_refuses_non_finite():
    with pytest.raises(ValueError, match="finite"):
        format_number(math.inf)


# --- hostile inputs ----------------------------------------------------------------------------------------------

HOSTILE = [
    # names, attributes, dunders, calls
    "__import__('os').system('echo hi')",
    "().__class__.__bases__[0].__subclasses__()",
    '"".__class__',
    '"a".__len__()',
    '"a".count("a").__class__',
    "(1).__class__",
    "1 .real",
    "x",
    "__builtins__",
    "globals()",
    "abs(-1)",
    'len("abc")',
    "print(1)",
    "open('/etc/passwd').read()",
    '"{}".format(1)',
    '"strawberry".upper()',
    '"strawberry".count',
    # functions, comprehensions, f-strings
    "(lambda: 1)()",
    "lambda x: x",
    "[x for x in range(10)]",
    '{x: 1 for x in "ab"}',
    '(x for x in "ab")',
    'f"{1+1}"',
    "f\"{__import__('os')}\"",
    # power towers and big numbers
    "2**10",
    "2**2**2**2**2**2",
    "9**9**9**9",
    "pow(2, 100000)",
    "1 << 10000",
    "9" * 700,
    "9" * 400 + "*" + "9" * 400,
    "(" + "*".join(["99999999999"] * 60) + ")",
    "1" + "0" * 400 + "*0.5",
    "1" + "0" * 400 + "/3",
    "1e999",
    "1e308*1e308",
    "-1e308-1e308",
    "1" * (MAX_SOURCE_CHARS + 1),
    # depth and size
    "(" * 300 + "1" + ")" * 300,
    "-" * 500 + "1",
    "1+" * 300 + "1",
    "(" + "1+" * 150 + "1" + ")",
    '"' + "a" * 2000 + '".count("a")',
    # unicode digits, null bytes, statements, walrus
    "٣",
    "٣+1",
    "１+1",
    "1\x00+1",
    "import os",
    "x = 1",
    "1; 2",
    "(x := 5)",
    "#comment",
    "1 +",
    "",
    "   ",
    # strings used as anything but .count
    '"a" * 10**9',
    "10**9 * 'a'",
    '"a" + "b"',
    '"%s" % 1',
    '"strawberry"',
    '"abc"[0]',
    '"abc"[::-1]',
    '"strawberry".count(x)',
    '"strawberry".count("r" * 2)',
    '"strawberry".count("r", 0)',
    '"strawberry".count(sub="r")',
    '("a" + "b").count("a")',
    'b"abc".count(b"a")',
    # other literals and operators
    "True + 1",
    "None",
    "1j * 2",
    "...",
    "[1, 2, 3]",
    "(1, 2)",
    "{1: 2}",
    "{1, 2}",
    "1 if 1 else 2",
    "1 < 2",
    "1 and 2",
    "not 1",
    "~1",
    "1 >> 1",
    "1 & 1",
    "1 | 1",
    "1 ^ 1",
    "2 @ 3",
    "await x",
    "(yield 1)",
    # division by zero
    "1/0",
    "1//0",
    "1%0",
    "1.0/0.0",
    "5 % 0.0",
]


@pytest.mark.parametrize("expression", HOSTILE, ids=lambda e: repr(e[:30]))
def test_hostile_input_is_refused_quickly(expression: str):
    # Best of three: the bound is on the work done, not on how busy the shared test machine happens to be.
    elapsed = []
    for _ in range(3):
        start = time.perf_counter()
        result = evaluate(expression)
        elapsed.append(time.perf_counter() - start)
    assert not result.ok and result.text is None
    assert result.reason and len(result.reason) < 200
    assert min(elapsed) < 0.05, f"{min(elapsed) * 1000:.1f} ms"


def test_there_are_many_hostile_inputs():
    assert len(set(HOSTILE)) >= 50


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("1/0", "division by zero"),
        ("2**3", "'**' (power) is not allowed"),
        ("x", "names are not allowed ('x')"),
        ("9" * 400 + "*" + "9" * 400, f"result would exceed {MAX_INT_BITS} bits"),
        ("9" * 700, f"number exceeds {MAX_INT_BITS} bits"),
        ('"strawberry".count(x)', ".count() takes exactly one quoted text argument"),
        ("f'{1}'", "f-strings are not allowed"),
        ("-" * 500 + "1", "nested too deeply"),
    ],
)
def test_refusal_reasons_say_why(expression: str, reason: str):
    assert reason in evaluate(expression).reason


@pytest.mark.parametrize("value", [None, b"1+1", 42])
def test_non_text_is_refused(value):
    assert not evaluate(value).ok


# --- threads (no signals: works off the main thread) -------------------------------------------------------------

THREAD_CASES = ["37*45", "0.2*50", "7/2", '"strawberry".count("r")', "1/0", "2**99", "(1+2)*3/4"]


def test_evaluates_in_a_plain_thread():
    expected = [evaluate(e) for e in THREAD_CASES]
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(evaluate(e) for e in THREAD_CASES))
    worker.start()
    worker.join(timeout=10)
    assert results == expected


def test_evaluates_concurrently_in_a_pool():
    expected = [evaluate(e) for e in THREAD_CASES] * 20
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert list(pool.map(evaluate, THREAD_CASES * 20)) == expected
