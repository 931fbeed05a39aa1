"""The logit lens over a reply (`chatapp.engine.lens`, `chatapp.engine.lens_pass`): the replay runs the model's own
forward, so at the last layer it is the distribution the reply was sampled from, in every weight format, skip mode
and prompt routing (a model whose prompts run dense included), for a chat session's later turn too; a skipped
layer's reading repeats the layer below's; the routing replayed is the reply's own."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from chatapp.engine.lens import ReplyLens
from chatapp.engine.lens_pass import reply_lens
from chatapp.errors import SettingsError
from chatapp.models import load_engine
from chatapp.settings import GenerationSettings
from chatapp.stt import STTConfig
from chatapp.stt.random_init import save_random_model_dir

SETTINGS = GenerationSettings(max_tokens=24, logprobs=5)
PROMPTS = ("What is 12 times 7?", "How many r are in strawberry?")
# How far the lens's last-layer probability may sit from the model's: the replay is the model's own forward, so only
# the order of a few float32 sums may differ (the torch step feeds one token through another kernel than `extend`).
TOLERANCE = 1e-3


def config(vocab_size: int, skip_mode: str, **extra) -> STTConfig:
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
        **extra,
    )


@pytest.fixture(scope="module")
def kv_model_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer) -> Path:
    """The weights of `routed_model_dir` (same seed and shapes), run in "kv" skip mode."""
    return save_random_model_dir(
        tmp_path_factory.mktemp("kv_model"), config(chat_tokenizer.get_vocab_size(), "kv"), chat_tokenizer
    )


@pytest.fixture(scope="module")
def dense_prompt_model_dir(tmp_path_factory: pytest.TempPathFactory, chat_tokenizer) -> Path:
    """A routed model whose config says `route_prompt` false: its prompts run through every layer."""
    return save_random_model_dir(
        tmp_path_factory.mktemp("dense_prompt_model"),
        config(chat_tokenizer.get_vocab_size(), "predict", route_prompt=False),
        chat_tokenizer,
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
    lens = reply_lens(
        engine, prompt_ids, reply, tables=range(len(reply.events)), dense=settings.routing == "off"
    )
    return lens, reply


def assert_reads_the_models_distribution(lens: ReplyLens, reply) -> None:
    """Every token's last-layer reading is the model's probability of it (the distribution it was sampled from);
    a token the model chose greedily has a decision depth, from which every layer's top token is it."""
    assert len(lens.tokens) == len(reply.events) > 0
    for token, event in zip(lens.tokens, reply.events, strict=True):
        last = token.layers[-1]
        assert token.token == event.token
        assert last.prob == pytest.approx(math.exp(event.logprobs.logprob), abs=TOLERANCE)
        model_top = [math.exp(a.logprob) for a in event.logprobs.top[:3]]
        assert [a.prob for a in last.top] == pytest.approx(model_top, abs=TOLERANCE)
        if not event.forced:
            assert last.rank == 1 and token.decision_depth is not None
            assert all(layer.rank == 1 for layer in token.layers[token.decision_depth :])
            if token.decision_depth > 0:
                assert token.layers[token.decision_depth - 1].rank > 1


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "int4"])
def test_the_last_layer_reads_the_models_own_distribution(routed_model_dir: Path, fmt: str) -> None:
    engine = load_engine(routed_model_dir, "cpu", dtype=fmt)
    for prompt in PROMPTS:
        assert_reads_the_models_distribution(*lens_of(engine, prompt))


def test_the_shipped_tiny_model_reads_its_own_distribution() -> None:
    engine = load_engine("tiny", "cpu")
    for prompt in PROMPTS:
        assert_reads_the_models_distribution(*lens_of(engine, prompt))


@pytest.mark.parametrize("fmt", ["float32", "int8"])
@pytest.mark.parametrize("model", ["kv", "predict", "dense prompts"])
def test_every_skip_mode_and_a_dense_prompt_read_the_models_own_distribution(
    kv_model_dir: Path, predict_model_dir: Path, dense_prompt_model_dir: Path, model: str, fmt: str
) -> None:
    """The replay prefills the prompt as the engine does: a model whose config says `route_prompt` false runs it
    through every layer there too (the lens used to route it, and read another distribution)."""
    directory = {"kv": kv_model_dir, "predict": predict_model_dir, "dense prompts": dense_prompt_model_dir}[model]
    engine = load_engine(directory, "cpu", dtype=fmt)
    assert engine.model.config.route_prompt == (model != "dense prompts")
    for prompt in PROMPTS:
        assert_reads_the_models_distribution(*lens_of(engine, prompt))


def test_the_routing_replayed_is_the_replys(routed_model_dir: Path) -> None:
    """Token j was predicted at the position of token j-1 (the prompt's last token for j = 0): the lens's computed
    flags there are the routing that position had when it was fed."""
    engine = load_engine(routed_model_dir, "cpu", dtype="float32")
    prompt = PROMPTS[0]
    steps = list(engine.generate([prompt], SETTINGS))
    lens, reply = lens_of(engine, prompt)
    recorded = [steps[0].prompt.computed[0][-1], *(event.computed for event in reply.events[:-1])]
    assert [event.token for event in reply.events] == [event.token for s in steps for event in s.tokens]
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
                    # The last layer reads the model's own logits, the others the lens head's product: the same
                    # state through two kernels, equal to float32 rounding.
                    below = token.layers[layer.layer - 1]
                    assert (layer.rank, [a.token for a in layer.top]) == (below.rank, [a.token for a in below.top])
                    assert layer.prob == pytest.approx(below.prob, abs=1e-5)
                    seen += 1
    assert seen > 0


def test_routing_off_runs_every_layer(routed_model_dir: Path) -> None:
    engine = load_engine(routed_model_dir, "cpu", dtype="float32")
    lens, reply = lens_of(engine, PROMPTS[0], GenerationSettings(max_tokens=12, logprobs=5, routing="off"))
    for token, event in zip(lens.tokens, reply.events, strict=True):
        assert all(token.computed) and all(layer.computed for layer in token.layers)
        assert token.layers[-1].prob == pytest.approx(math.exp(event.logprobs.logprob), abs=TOLERANCE)


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
        conversation_lens(engine, [1, 2, 3], [])
    with pytest.raises(SettingsError, match=r"within 1\.\.2"):
        conversation_lens(engine, [1, 2, 3], [3])


@pytest.mark.parametrize("mode", ["strict", "kv", "predict"])
def test_a_later_turn_of_a_session_reads_the_models_own_distribution(
    routed_model_dir: Path, kv_model_dir: Path, predict_model_dir: Path, mode: str
) -> None:
    """A chat session prefills each turn on top of its cache; the lens replays the conversation up to the answer as
    one prompt, then the answer token by token: the same distribution, in every turn."""
    from chatapp.engine.lens_pass import AnswerLens

    directory = {"strict": routed_model_dir, "kv": kv_model_dir, "predict": predict_model_dir}[mode]
    engine = load_engine(directory, "cpu", dtype="float32")
    session = engine.session()
    for text in PROMPTS:
        reply = engine.new_reply()
        for step in session.send(text, SETTINGS):
            reply.add_step(step)
        ids = list(session.token_ids)
        start = len(ids) - len(reply.events)
        assert ids[start:] == [event.token for event in reply.events]
        lens = AnswerLens(engine, ids, range(start, len(ids))).result(tables=range(len(reply.events)))
        assert_reads_the_models_distribution(lens, reply)
