"""Hypothesis strategies shared by the trie tests: regexes built from a small grammar."""

from __future__ import annotations

from hypothesis import strategies as st

ATOMS = ["a", "b", "c", "0", "7", "é", "漢", '"', " ", r"\d", ".", "[ab]", "[^a]", "[a-c0-2]", r"\.", "[é漢x]", r"\s"]

REGEX_CHARS = 'abc07é漢" .x\n12-€'
"""Characters the test strings are drawn from: the atoms' characters plus a few none of them name."""


def _concat(parts: list[str]) -> str:
    return "".join(parts)


def _alternation(parts: list[str]) -> str:
    return "(" + "|".join(parts) + ")"


def _extend(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    repeated = st.tuples(children, st.sampled_from(["*", "+", "?", "{1,2}", "{0,3}", "{2}"]))
    return st.one_of(
        st.lists(children, min_size=2, max_size=3).map(_concat),
        st.lists(children, min_size=2, max_size=3).map(_alternation),
        repeated.map(lambda pair: f"({pair[0]}){pair[1]}"),
    )


def regexes_over(atoms: list[str]) -> st.SearchStrategy[str]:
    """Regexes over `atoms` with concatenation, alternation, repetition and optional parts."""
    return st.recursive(st.sampled_from(atoms), _extend, max_leaves=8)


regexes = regexes_over(ATOMS)
"""Regexes over literals, classes (negated too), `.`, alternation, repetition and optional parts."""
