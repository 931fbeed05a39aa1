"""End to end: a scripted "model" (a fixed token stream) under each built-in program yields the expected text and
tags, on the batched automaton and the reference interpreter alike, all programs in one batch."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from chatapp.ttfa import Automaton, Contains, ProgramBuilder, compile_program, load_program
from chatapp.ttfa.program import Program
from chatapp.ttfa.reference import ReferenceRow
from chatapp.ttfa.vocab import TokenVocab

FILLER = "x"  # one token the scripted model "says" while the automaton forces; always replaced


@dataclass
class Script:
    program: str
    model: list[str]  # the model's tokens by text; special names and plain text (tokenized canonically)
    segments: list[tuple[tuple[str, ...], str]]  # expected (tags, text) runs of the output


def model_stream(vocab: TokenVocab, parts: list[str]) -> list[int]:
    return [t for part in parts for t in vocab.encode(part)]


def segments(vocab: TokenVocab, tokens: list[int], tags: list[tuple[str, ...]]) -> list[tuple[tuple[str, ...], str]]:
    runs: list[tuple[tuple[str, ...], list[int]]] = []
    for token, tag in zip(tokens, tags, strict=True):
        if runs and runs[-1][0] == tag:
            runs[-1][1].append(token)
        else:
            runs.append((tag, [token]))
    return [(tag, vocab.tokenizer.decode(ids, skip_special_tokens=False)) for tag, ids in runs]


def run_batch(programs: list[Program], streams: list[list[int]]) -> list[tuple[list[int], list[bool], list]]:
    """Step all rows together until every program halted; each row's output up to its halt."""
    automaton = Automaton(programs, list(range(len(programs))))
    references = [ReferenceRow(p) for p in programs]
    outputs: list[tuple[list[int], list[bool], list]] = [([], [], []) for _ in programs]
    length = max(len(s) for s in streams)
    for i in range(length):
        if automaton.done():
            break
        step_tokens = [s[i] if i < len(s) else 0 for s in streams]
        was_halted = automaton.halted().tolist()
        out, forced, tags = automaton.step(torch.tensor(step_tokens))
        for b, (token, flag, row_tags) in enumerate(zip(out.tolist(), forced.tolist(), tags.tolist(), strict=True)):
            expected = references[b].step(step_tokens[b])
            names = tuple(n for n, on in zip(automaton.tag_names, row_tags, strict=True) if on)
            assert (token, flag, set(names)) == (expected[0], expected[1], set(expected[2]))
            if not was_halted[b]:
                outputs[b][0].append(token)
                outputs[b][1].append(flag)
                outputs[b][2].append(names)
    assert automaton.done()
    return outputs


def test_builtin_programs_script_the_turn(ttfa_tokenizer) -> None:
    vocab = TokenVocab(ttfa_tokenizer)
    scripts = [
        Script(
            "chat",
            ["Paris is the capital of France.", "<|assistant_end|>"],
            [(("answer",), "Paris is the capital of France.<|assistant_end|>")],
        ),
        Script(
            "think",
            [FILLER, "2 plus 2 is 4.", "</think>", "The answer is 4.", "<|assistant_end|>"],
            [(("think",), "<think>2 plus 2 is 4.</think>"), (("answer",), "The answer is 4.<|assistant_end|>")],
        ),
        Script(
            "calc",
            [
                FILLER,
                "37*45",
                "<|python_end|>",
                "<|output_start|>",
                "1665",
                "<|output_end|>",
                "37*45 is 1665.",
                "<|assistant_end|>",
            ],
            [
                (("tool",), "<|python_start|>37*45<|python_end|>"),
                (("answer",), "<|output_start|>1665<|output_end|>37*45 is 1665.<|assistant_end|>"),
            ],
        ),
        # The model writes the canonical tokens of the whole object; the automaton forces the same keys, and the
        # merged '",' and '."}' tokens take the jumps.
        Script(
            "json",
            ['{"topic": "geography", "answer": "Paris is the capital of France."}', "<|assistant_end|>"],
            [
                (("topic",), '{"topic": "geography",'),
                (("answer",), ' "answer": "Paris is the capital of France."}'),
                ((), "<|assistant_end|>"),
            ],
        ),
    ]
    programs = [load_program(s.program, ttfa_tokenizer) for s in scripts]
    outputs = run_batch(programs, [model_stream(vocab, s.model) for s in scripts])
    for script, (tokens, _, tags) in zip(scripts, outputs, strict=True):
        assert segments(vocab, tokens, tags) == script.segments, script.program


def test_json_bare_quotes_and_timeouts_still_close_the_object(ttfa_tokenizer) -> None:
    """Closing quotes without the merged comma or brace, and values that never close, still give the shape."""
    vocab = TokenVocab(ttfa_tokenizer)
    program = load_program("json", ttfa_tokenizer)
    # Four feed tokens, the value, a bare quote, then one filler for the forced ',' and four for the next key.
    bare = model_stream(vocab, [*[FILLER] * 4, "math", '"', *[FILLER] * 5, "37", '"', FILLER, "<|assistant_end|>"])
    rambling = model_stream(vocab, [" word"] * 400)  # no quote: both values time out
    outputs = run_batch([program, program], [bare, rambling])
    bare_text, rambling_text = (vocab.tokenizer.decode(t, skip_special_tokens=False) for t, _, _ in outputs)
    assert json.loads(bare_text.removesuffix("<|assistant_end|>")) == {"topic": "math", "answer": "37"}
    parsed = json.loads(rambling_text.removesuffix("<|assistant_end|>"))
    assert list(parsed) == ["topic", "answer"] and parsed["topic"].startswith(" word word")
    tokens, forced, _ = outputs[1]
    assert forced[-1] and tokens[-1] == vocab.token("<|assistant_end|>")  # budget 1: the end is forced


def test_think_budget_forces_the_end_of_thinking(ttfa_tokenizer) -> None:
    vocab = TokenVocab(ttfa_tokenizer)
    source = (
        ProgramBuilder("short-think", tags=["think", "answer"])
        .zone("think", force="<think>", until="</think>", budget=5, tags=["think"])
        .zone("answer", until="<|assistant_end|>", tags=["answer"])
        .build()
    )
    program = compile_program(source, ttfa_tokenizer)
    stream = model_stream(vocab, [FILLER, " word word word word word", "Done.", "<|assistant_end|>"])
    ((tokens, forced, tags),) = run_batch([program], [stream])
    end_of_thinking = vocab.token("</think>")
    assert tokens[4] == end_of_thinking and forced[4]  # the 5th token of the zone
    assert forced[:5] == [True, False, False, False, True]
    assert tags[4] == ("think",) and tags[5] == ("answer",)


def test_a_newline_trigger_fires_inside_merged_tokens(ttfa_tokenizer) -> None:
    """`{contains = "\\n"}`: the model's paragraph break comes as a merged token, and the zone still ends there."""
    vocab = TokenVocab(ttfa_tokenizer)
    source = (
        ProgramBuilder("line", tags=["line"])
        .zone("line", until=Contains("\n"), tags=["line"])
        .zone("rest", until="<|assistant_end|>")
        .build()
    )
    program = compile_program(source, ttfa_tokenizer)
    stream = model_stream(vocab, ["A list:\n\n\n- one", "<|assistant_end|>"])
    merged = next(t for t in stream if "\n" in vocab.texts[t])
    assert vocab.texts[merged] != "\n"  # BPE merged the newline with its neighbours
    ((tokens, _, tags),) = run_batch([program], [stream])
    ends = tokens.index(merged)
    assert all(t == ("line",) for t in tags[: ends + 1]) and all(t == () for t in tags[ends + 1 :])
