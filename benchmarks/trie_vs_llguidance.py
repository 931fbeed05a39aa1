"""Token-mask cost: chatapp's compiled trie walk against llguidance and a brute-force numpy baseline, in one process.

Tokenizers are byte-level BPEs trained locally (no hub): 32k merges on the standard library's sources, ~128k on the
standard library plus the venv's site-packages sources. They are trained once and cached under
`$CHATAPP_BENCH_CACHE` (default: `<tmp>/chatapp-bench-cache`); the first run spends a minute or two training.

For each regex (sparse to dense) the canonical tokens of a sample text give a path of grammar states. Both
engines cache masks per grammar (lexer) state, so two costs matter, and each is measured for both:
- cold: the first mask of a state with no caches. chatapp: `SlicedWalker.mask` with the state's slice verdicts
  forgotten (universality checks + numba walks of the non-universal slices and the rest); llguidance: a fresh
  `LLMatcher` that has consumed the path so far, filling a preallocated bitmask (this includes building its lazy
  lexer DFA states; chatapp compiles its DFA up front, timed separately);
- in loop: one mask per step along the path with one long-lived matcher / `Constraint`, as in generation: states
  seen before hit the caches.
Also shown: chatapp's full walk (the seed's loop over the whole trie, no slices) and brute force (the DFA over
every token's bytes in numpy, first few states). chatapp cold and brute-force figures are the minimum of a few
repeats, llguidance cold the minimum over two fresh matchers (the box is shared). Masks are checked equal to
llguidance's at every state. Run:
`.venv/bin/python benchmarks/trie_vs_llguidance.py`.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
from tokenizers import Tokenizer

from chatapp.trie.bitmask import bitmask_to_bools
from chatapp.trie.constraint import Constraint
from chatapp.trie.dfa import DEAD
from chatapp.trie.json_schema import json_literal, schema_to_regex
from chatapp.trie.regex import compile_regex
from chatapp.trie.token_bytes import vocab_bytes
from chatapp.trie.toktrie import TokTrie
from chatapp.trie.vocab import ConstraintVocab
from chatapp.trie.walk import TokenColumns
from tests.trie.local_tokenizers import cached_source_tokenizer

CACHE = Path(os.environ.get("CHATAPP_BENCH_CACHE", Path(tempfile.gettempdir()) / "chatapp-bench-cache"))
TOKENIZERS = (
    # name, vocab size, characters of source text, include site-packages
    ("32k", 32_000, 12_000_000, False),
    ("128k", 128_000, 160_000_000, True),
)
ANSWER = {
    "type": "object",
    "properties": {"topic": {"type": "string"}, "answer": {"type": "string"}},
    "required": ["topic", "answer"],
}
REGEXES = (
    ("digits", r"[0-9]+", "31415926535897932384626433832795"),
    ("identifier", r"[a-zA-Z_][a-zA-Z0-9_]*", "assert_equal_self_value_from_the_test_case"),
    ("json answer", schema_to_regex(ANSWER), json_literal({"topic": "math", "answer": "It is 42, I think."})),
    ("json string", r'"([^"\\\x00-\x1f\x7f]|\\["\\/bfnrt])*"', '"The quick brown fox, said she: return None."'),
    ("code line", r"[^\n]*\n", "        return self.assertEqual(value, None)  # check it\n"),
    ("any text", r"[\s\S]*", "def f(x):\n    '''Any text at all, é 漢.'''\n    return x + 1\n"),
)
MAX_STATES = 24
BRUTE_STATES = 4
REPEATS = 3


@dataclass
class Row:
    tokenizer: str
    regex: str
    states: int
    compile_ms: float
    cold_us: float
    llg_cold_us: float
    loop_us: float
    llg_loop_us: float
    walk_us: float
    brute_us: float


def best_of(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """Minimum wall time of `fn` in microseconds (the least disturbed run on a shared machine)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        best = min(best, (time.perf_counter_ns() - start) / 1000)
    return best


def build_times(tokenizer: Tokenizer) -> tuple[float, float, float]:
    """Seconds (best of 3) for: token bytes, trie build, the whole `ConstraintVocab` (bytes, trie, slices), and
    llguidance's `LLTokenizer` construction (its token bytes, trie and slices)."""
    vb = vocab_bytes(tokenizer)
    t_bytes = best_of(lambda: vocab_bytes(tokenizer)) / 1e6
    t_trie = best_of(lambda: TokTrie.build(vb.tokens)) / 1e6
    t_vocab = best_of(lambda: ConstraintVocab.from_tokenizer(tokenizer)) / 1e6
    text = tokenizer.to_str()
    t_llg = best_of(lambda: llguidance.LLTokenizer(text)) / 1e6
    return t_bytes, t_trie, t_vocab, t_llg


def bench_regex(
    name: str, tok_name: str, vocab: ConstraintVocab, ll_tok, brute: TokenColumns, rx: str, text: str
) -> Row:
    compile_regex.cache_clear()
    start = time.perf_counter()
    dfa = compile_regex(rx)
    compile_ms = (time.perf_counter() - start) * 1000
    end = vocab.token_id("<|assistant_end|>")
    grammar = llguidance.LLMatcher.grammar_from_regex(rx)
    buffer = llg_numpy.allocate_token_bitmask(1, ll_tok.vocab_size)
    path = vocab.encode(text)[: MAX_STATES - 1]

    cold, llg_cold, walk, brute_times = [], [], [], []
    state = dfa.start
    for step in range(len(path) + 1):

        def first_visit(s: int = state) -> None:
            vocab.sliced.forget(dfa, s)
            vocab.sliced.mask(dfa, s)

        cold.append(best_of(first_visit))
        walk.append(best_of(lambda s=state: vocab.walker.mask(dfa, s)))
        llg_cold.append(min(_llg_fresh_mask(ll_tok, grammar, path[:step], buffer) for _ in range(2)))
        if step < BRUTE_STATES:
            brute_times.append(best_of(lambda s=state: (brute.final_states(dfa, s) != DEAD) & brute.nonempty, 1))
        if step < len(path):
            state = dfa.step(state, vocab.token_bytes(path[step]))

    ours = Constraint(vocab, dfa, end, token_healing=False)
    theirs = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    loop, llg_loop = [], []
    for step in range(len(path) + 1):
        start = time.perf_counter_ns()
        mask = ours.allowed_mask()
        loop.append((time.perf_counter_ns() - start) / 1000)
        start = time.perf_counter_ns()
        llg_numpy.fill_next_token_bitmask(theirs, buffer)
        llg_loop.append((time.perf_counter_ns() - start) / 1000)
        ours_bits = bitmask_to_bools(mask, vocab.vocab_size)
        if not (ours_bits == bitmask_to_bools(buffer[0].view(np.uint32), vocab.vocab_size)).all():
            raise AssertionError(f"{tok_name} {name}: masks differ from llguidance at step {step}")
        if step < len(path):
            ours.consume(path[step])
            theirs.consume_token(path[step])
    return Row(
        tok_name,
        name,
        len(path) + 1,
        compile_ms,
        statistics.median(cold),
        statistics.median(llg_cold),
        statistics.median(loop),
        statistics.median(llg_loop),
        statistics.median(walk),
        statistics.median(brute_times),
    )


def _llg_fresh_mask(ll_tok, grammar: str, prefix: list[int], buffer: np.ndarray) -> float:
    """Microseconds for llguidance's first mask in a fresh matcher after `prefix` (no cached lexer states)."""
    matcher = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
    matcher.consume_tokens(prefix)
    start = time.perf_counter_ns()
    llg_numpy.fill_next_token_bitmask(matcher, buffer)
    return (time.perf_counter_ns() - start) / 1000


def main() -> None:
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or 'unknown CPU'}")
    rows: list[Row] = []
    builds = []
    for tok_name, size, chars, site_packages in TOKENIZERS:
        start = time.perf_counter()
        tokenizer = cached_source_tokenizer(CACHE, size, max_chars=chars, include_site_packages=site_packages)
        print(f"{tok_name}: {tokenizer.get_vocab_size()} tokens (ready in {time.perf_counter() - start:.1f} s)")
        builds.append((tok_name, tokenizer.get_vocab_size(), *build_times(tokenizer)))
        vocab = ConstraintVocab.from_tokenizer(tokenizer)
        ll_tok = llguidance.LLTokenizer(tokenizer.to_str(), eos_token=vocab.token_id("<|assistant_end|>"))
        brute = TokenColumns.build(vocab.bytes.tokens)
        vocab.walker.mask(compile_regex("a"), compile_regex("a").start)  # compile / load the numba kernels
        for name, rx, text in REGEXES:
            rows.append(bench_regex(name, tok_name, vocab, ll_tok, brute, rx, text))

    print("\nbuild (s): chatapp token bytes, trie, whole ConstraintVocab vs llguidance.LLTokenizer")
    print("| vocab | tokens | token bytes | trie build | ConstraintVocab | llguidance tokenizer |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, n, t_bytes, t_trie, t_vocab, t_llg in builds:
        print(f"| {name} | {n} | {t_bytes:.3f} | {t_trie:.3f} | {t_vocab:.3f} | {t_llg:.3f} |")
    print("\nmask time in µs, median over the states of each path; ratio = chatapp / llguidance")
    print(
        "| vocab | regex | states | chatapp cold | llguidance cold | ratio | chatapp in loop | llguidance in loop "
        "| ratio | chatapp full walk | brute force | regex compile (ms) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r.tokenizer} | {r.regex} | {r.states} | {r.cold_us:.1f} | {r.llg_cold_us:.1f} | "
            f"{r.cold_us / r.llg_cold_us:.2f} | {r.loop_us:.1f} | {r.llg_loop_us:.1f} | "
            f"{r.loop_us / r.llg_loop_us:.2f} | {r.walk_us:.1f} | {r.brute_us:.0f} | {r.compile_ms:.1f} |"
        )
    cold_ratio = statistics.median(r.cold_us / r.llg_cold_us for r in rows)
    loop_ratio = statistics.median(r.loop_us / r.llg_loop_us for r in rows)
    print(f"\nmedian ratio chatapp / llguidance: cold {cold_ratio:.2f}, in loop {loop_ratio:.2f}")


if __name__ == "__main__":
    main()
