"""The logit lens over a reply (`chatapp.engine.lens`, `chatapp.stt.lens`): at the last layer it is the model's own
output distribution, in every weight format; a skipped layer's reading repeats the layer below's; in "kv" mode the
skipped tokens' K/V reach later tokens as the decode path wrote them; the routing replayed is the reply's own."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from chatapp.engine.lens import ReplyLens
from chatapp.engine.lens_pass import reply_lens
from chatapp.errors import SettingsError
from chatapp.models import load_engine
from chatapp.settings import GenerationSettings
from chatapp.stt import STTConfig
from chatapp.stt.random_init import save_random_model_dir

SETTINGS = GenerationSettings(max_tokens=24, logprobs=5)
PROMPTS = ("What is 12 times 7?", "How many r are in strawberry?")
# How far the lens's last-layer log-probability may sit from the decode step's: float32 is the same arithmetic in
# another order; the others round activations to bfloat16 (and int8/int4 run other kernels at decode).
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "int8": 1e-2, "int4": 1e-2}


def config(vocab_size: int, skip_mode: str) -> STTConfig:
    return STTConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        routing_trained=True,
        skip_mode=skip_mode,
    )


@pytest.fixture(scope="module")
def kv_model_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer) -> Path:
    """The weights of `routed_model_dir` (same seed and shapes), run in "kv" skip mode."""
    return save_random_model_dir(
        tmp_path_factory.mktemp("kv_model"), config(chat_tokenizer.get_vocab_size(), "kv"), chat_tokenizer
    )


@pytest.fixture(scope="module")
def predict_model_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer) -> Path:
    """The same shapes in "predict" skip mode, its skip predictors random (`random_init`)."""
    return save_random_model_dir(
        tmp_path_factory.mktemp("predict_model"), config(chat_tokenizer.get_vocab_size(), "predict"), chat_tokenizer
    )


def lens_of(engine, prompt: str, settings: GenerationSettings = SETTINGS) -> tuple[ReplyLens, object]:
    """Generate a reply to `prompt` and return its lens (every token's table) and the reply."""
    steps = list(engine.generate([prompt], settings))
    reply = engine.new_reply()
    for step in steps:
        reply.add_step(step)
    prompt_ids = engine.chat_format.render_for_completion([{"role": "user", "content": prompt}])
    computed = steps[0].prompt.computed
    lens = reply_lens(
        engine,
        prompt_ids,
        reply,
        None if computed is None else computed[0],
        tables=range(len(reply.events)),
        dense=settings.routing == "off",
    )
    return lens, reply


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_the_last_layer_reads_the_models_own_distribution(routed_model_dir: Path, fmt: str) -> None:
    engine = load_engine(routed_model_dir, "cpu", dtype=fmt)
    for prompt in PROMPTS:
        lens, reply = lens_of(engine, prompt)
        assert len(lens.tokens) == len(reply.events) > 0
        for token, event in zip(lens.tokens, reply.events, strict=True):
            last = token.layers[-1]
            assert token.token == event.token
            assert math.log(last.prob) == pytest.approx(event.logprobs.logprob, abs=TOLERANCE[fmt])
            if fmt == "float32":
                assert [a.token for a in last.top] == [a.token for a in event.logprobs.top[:3]]
            # Greedy: the model's top token is the emitted one, so its decision depth exists and the last layer's
            # rank is 1 (in a rounded format, unless the top two are within the rounding).
            if last.rank == 1:
                assert token.decision_depth is not None
                assert all(layer.rank == 1 for layer in token.layers[token.decision_depth :])
                if token.decision_depth > 0:
                    assert token.layers[token.decision_depth - 1].rank > 1


def test_the_routing_replayed_is_the_replys(routed_model_dir: Path) -> None:
    """Token j was predicted at the position of token j-1 (the prompt's last token for j = 0): the lens's computed
    flags there are the routing that position had when it was fed."""
    engine = load_engine(routed_model_dir, "cpu", dtype="float32")
    prompt = PROMPTS[0]
    steps = list(engine.generate([prompt], SETTINGS))
    lens, reply = lens_of(engine, prompt)
    recorded = [steps[0].prompt.computed[0][-1], *(event.computed for event in reply.events[:-1])]
    assert [token.computed for token in lens.tokens] == [tuple(flags) for flags in recorded]
    skipped = sum(not flag for flags in recorded for flag in flags)
    assert 0 < skipped < len(recorded) * len(engine.stt_layers)  # the test sees both kinds of layer


@pytest.mark.parametrize("mode", ["strict", "kv"])
def test_a_skipped_layer_reads_as_the_layer_below(routed_model_dir: Path, kv_model_dir: Path, mode: str) -> None:
    engine = load_engine(routed_model_dir if mode == "strict" else kv_model_dir, "cpu", dtype="float32")
    assert engine.model.config.skip_mode == mode
    seen = 0
    for prompt in PROMPTS:
        lens, _ = lens_of(engine, prompt)
        for token in lens.tokens:
            for layer in token.layers:
                if layer.routed and not layer.computed:
                    below = token.layers[layer.layer - 1]
                    assert (layer.prob, layer.rank, layer.top) == (below.prob, below.rank, below.top)
                    seen += 1
    assert seen > 0


def test_kv_mode_reads_what_the_skip_path_wrote(routed_model_dir: Path, kv_model_dir: Path) -> None:
    """The same weights and the same routing in the two modes differ only in the K/V a skipped token leaves; the kv
    model's lens matches the kv model's own output, so the lens replayed the K/V its skip path wrote."""
    kv = load_engine(kv_model_dir, "cpu", dtype="float32")
    strict = load_engine(routed_model_dir, "cpu", dtype="float32")
    prompt = PROMPTS[1]
    kv_lens, kv_reply = lens_of(kv, prompt)
    # The kv reply's tokens and routing, replayed by the strict model: the readings differ.
    steps = list(kv.generate([prompt], SETTINGS))
    prompt_ids = kv.chat_format.render_for_completion([{"role": "user", "content": prompt}])
    as_strict = reply_lens(
        strict, prompt_ids, kv_reply, steps[0].prompt.computed[0], tables=range(len(kv_reply.events))
    )
    assert [t.computed for t in as_strict.tokens] == [t.computed for t in kv_lens.tokens]
    differs = 0
    for kv_token, strict_token, event in zip(kv_lens.tokens, as_strict.tokens, kv_reply.events, strict=True):
        assert math.log(kv_token.layers[-1].prob) == pytest.approx(event.logprobs.logprob, abs=1e-4)
        differs += abs(math.log(strict_token.layers[-1].prob) - event.logprobs.logprob) > 1e-2
    assert differs > 0


def test_routing_off_runs_every_layer(routed_model_dir: Path) -> None:
    engine = load_engine(routed_model_dir, "cpu", dtype="float32")
    lens, reply = lens_of(engine, PROMPTS[0], GenerationSettings(max_tokens=12, logprobs=5, routing="off"))
    for token, event in zip(lens.tokens, reply.events, strict=True):
        assert all(token.computed) and all(layer.computed for layer in token.layers)
        assert math.log(token.layers[-1].prob) == pytest.approx(event.logprobs.logprob, abs=1e-4)


def test_layer_depths_split_each_routed_layer(routed_model_dir: Path) -> None:
    engine = load_engine(routed_model_dir, "cpu", dtype="float32")
    lens, _ = lens_of(engine, PROMPTS[1])
    splits = lens.layer_depths()
    assert [s.layer for s in splits] == list(engine.stt_layers)
    settled = [t for t in lens.tokens if t.decision_depth is not None]
    for slot, split in enumerate(splits):
        assert split.skipped_tokens + split.computed_tokens == len(settled)
        skipped = [t.decision_depth for t in settled if not t.computed[slot]]
        if skipped:
            assert split.skipped == pytest.approx(sum(skipped) / len(skipped))


def test_bad_requests_are_named(routed_model_dir: Path) -> None:
    from chatapp.engine.lens_pass import conversation_lens

    engine = load_engine(routed_model_dir, "cpu", dtype="float32")
    with pytest.raises(SettingsError, match="no tokens"):
        conversation_lens(engine, [1, 2, 3], None, [])
    with pytest.raises(SettingsError, match=r"within 1\.\.2"):
        conversation_lens(engine, [1, 2, 3], None, [3])
    with pytest.raises(SettingsError, match="routing for 1 layers"):
        conversation_lens(engine, [1, 2, 3], [(True,), None, None], [1])


@pytest.mark.parametrize("mode", ["strict", "kv", "predict"])
def test_replaying_against_the_sessions_cache_reads_what_the_forward_reads(
    routed_model_dir: Path, kv_model_dir: Path, predict_model_dir: Path, mode: str
) -> None:
    """An answer still in its chat session's cache is replayed there (each token attends to the entries it saw when
    it was fed): the same readings as a forward over the whole conversation, for a second turn too; in "predict"
    mode a skipped token carries its predicted update in both."""
    from chatapp.engine.lens_pass import AnswerLens

    directory = {"strict": routed_model_dir, "kv": kv_model_dir, "predict": predict_model_dir}[mode]
    engine = load_engine(directory, "cpu", dtype="float32")
    session = engine.session()
    for turn, text in enumerate(PROMPTS):
        reply = engine.new_reply()
        prompt_routing = None
        for step in session.send(text, SETTINGS):
            if step.prompt is not None:
                prompt_routing = step.prompt.computed[0]
            reply.add_step(step)
        ids = list(session.token_ids)
        start = len(ids) - len(reply.events)
        assert ids[start:] == [event.token for event in reply.events]
        computed = [None] * (start - len(prompt_routing)) + list(prompt_routing)
        computed += [event.computed for event in reply.events]
        targets = range(start, len(ids))
        replayed = AnswerLens(engine, ids, computed, targets, cache=session.cache)
        forward = AnswerLens(engine, ids, computed, targets)
        assert replayed.replayed and not forward.replayed, turn
        assert replayed.flags == forward.flags
        assert torch.allclose(replayed.states, forward.states, atol=1e-4, rtol=1e-4)
        assert replayed.depths == forward.depths
