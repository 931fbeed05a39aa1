"""Hypothesis strategies for random compiled programs and token streams that keep hitting their triggers."""

from __future__ import annotations

from hypothesis import strategies as st

from chatapp.ttfa.program import Program, Zone

VOCAB = 10  # tiny, so random tokens hit triggers and feed tokens often
TAGS = ("a", "b", "c")


@st.composite
def zones(draw: st.DrawFn, index: int, count: int, tag_names: tuple[str, ...]) -> Zone:
    tokens = st.integers(0, VOCAB - 1)
    feed = tuple(draw(st.lists(tokens, max_size=3)))
    jump_to = draw(st.none() | st.integers(0, count))  # count == HALT; index itself is a self-loop
    return Zone(
        label=f"z{index}",
        feed=feed,
        until=frozenset(draw(st.sets(tokens, max_size=3))),
        jump_on=frozenset(draw(st.sets(tokens, max_size=2))) if jump_to is not None else frozenset(),
        jump_to=jump_to,
        timeout_token=draw(st.none() | tokens),
        tags=tuple(draw(st.sets(st.sampled_from(tag_names)))) if tag_names else (),
        budget=draw(st.none() | st.integers(0, 4) | st.just(len(feed) + 1)),
    )


@st.composite
def programs(draw: st.DrawFn, name: str = "p") -> Program:
    count = draw(st.integers(0, 4))
    # Programs declare different tags in different orders, so linking must remap tag columns.
    tag_names = tuple(draw(st.permutations(TAGS)))[: draw(st.integers(0, len(TAGS)))]
    return Program(
        name=name,
        zones=tuple(draw(zones(i, count, tag_names)) for i in range(count)),
        tag_names=tag_names,
        pad=draw(st.integers(0, VOCAB - 1)),
        vocab_size=VOCAB,
        max_genned_per_zone=draw(st.none() | st.integers(1, 6)),
    )


def model_tokens(length: int) -> st.SearchStrategy[list[int]]:
    """Tokens in the vocabulary (so triggers fire often) and a few outside it (which must never fire)."""
    return st.lists(st.integers(0, VOCAB - 1) | st.integers(VOCAB, VOCAB + 3), min_size=length, max_size=length)
