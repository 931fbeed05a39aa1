"""`chatapp route`: the frozen-backbone routing fit, on a converted GGUF and through its pieces."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from chatapp.cli import app
from chatapp.cli.route import route_dialogues
from chatapp.models.registry import tiny_model_dir
from chatapp.models.route_prompts import route_prompts_file
from chatapp.models.smollm2 import PARTS_DIR, PREPARED_STAMP
from chatapp.stt import STTConfig
from chatapp.stt.layers import CausalRouter, router_probs, select
from chatapp.training.corpus import read_dialogues
from chatapp.training.route import Conversation, batches, fold_cutoff, selected_by_score, with_routed_layers
from tests.training.conftest import ROUTE_PROMPTS, tiny_stt

runner = CliRunner()


def _fast(converted: Path, out: Path, prompts: Path) -> list[str]:
    return ["route", str(converted), "--out", str(out), "--prompts", str(prompts), "--answer-tokens", "12", "--budget", "1e9"]


def test_route_a_converted_gguf_then_it_skips(converted: Path, route_prompts: Path, tmp_path: Path) -> None:
    """convert -> route on the user's prompts -> the model loads with trained routers in kv mode, and a reply
    skips tokens."""
    out = tmp_path / "routed"
    args = _fast(converted, out, route_prompts)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    config = json.loads((out / "config.json").read_text())
    report = json.loads((out / "routing.json").read_text())
    assert config["routing_trained"] is True and config["skip_mode"] == "kv" and config["router_threshold"] == 0.5
    assert config["stt_layers"] == report["chosen"]["layers"] and config["stt_layers"]
    assert report["single_layer"] and report["fit_tokens"] > 0 and report["held_out_tokens"] > 0
    assert report["dense_prompts"] is False and config["route_prompt"] is True  # the converted model routes prompts
    # The source is untouched; tokenizer files came along.
    assert json.loads((converted / "config.json").read_text())["routing_trained"] is False
    assert (out / "tokenizer.json").is_file()

    from chatapp.models import load_engine
    from chatapp.settings import GenerationSettings

    engine = load_engine(out, dtype="float32")
    reply = engine.generate_batch(["Hello there, how are you?"], GenerationSettings(max_tokens=24))[0]
    decisions = [c for e in reply.events if e.computed is not None for c in e.computed]
    assert decisions and not all(decisions), "a budget of 1e9 routes at the highest rate: some tokens must skip"


def test_route_a_converted_gguf_in_predict_mode(converted: Path, route_prompts: Path, tmp_path: Path) -> None:
    """convert -> route --skip-mode predict -> skipped tokens carry fitted predictors' updates, and the model
    serves them in every path (the served int8 model decodes through the C step)."""
    out = tmp_path / "predict"
    args = _fast(converted, out, route_prompts)
    result = runner.invoke(app, [*args, "--skip-mode", "predict", "--dense-prompts"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    report = json.loads((out / "routing.json").read_text())
    assert config["skip_mode"] == "predict" and config["stt_layers"]
    # Fitted on the replies' tokens with the prompts dense, and served that way.
    assert report["dense_prompts"] is True and config["route_prompt"] is False
    assert set(map(int, report["predictor_explained"])) >= set(config["stt_layers"])
    # Its levels: "quality" at the calibrated threshold, each level measured on the held-out replies.
    assert config["routing_levels"]["quality"] == 0.5 and set(report["level_measures"]) == set(config["routing_levels"])
    for level in config["routing_levels"]:
        assert f"level {level} (threshold" in result.output

    from chatapp.models import load_engine
    from chatapp.settings import GenerationSettings

    for dtype in ("float32", "int8"):
        engine = load_engine(out, dtype=dtype)
        for index in config["stt_layers"]:
            predictor = engine.model.model.layers[index].skip_predictor
            assert predictor is not None and predictor.up.weight.abs().sum() > 0
        reply = engine.generate_batch(["Hello there, how are you?"], GenerationSettings(max_tokens=24))[0]
        decisions = [c for e in reply.events if e.computed is not None for c in e.computed]
        assert decisions and not all(decisions), "a budget of 1e9 routes at the highest rate: some tokens must skip"


def test_route_rejects_bad_options(converted: Path, tmp_path: Path) -> None:
    for args, message in [
        (["--layers", "a,b"], "comma-separated list"),
        (["--layers", "7"], "do not exist"),
        (["--skip-mode", "sometimes"], "use one of"),
    ]:
        result = runner.invoke(app, ["route", str(converted), "--out", str(tmp_path / "x"), *args])
        assert result.exit_code == 1, result.output
        assert message in result.output
    result = runner.invoke(app, ["route", str(tmp_path / "missing")])
    assert result.exit_code == 1 and "does not exist" in result.output


def test_route_the_tiny_model_on_the_users_prompts(route_prompts: Path, tmp_path: Path) -> None:
    """`--prompts FILE`: the model answers the file's user turns (every conversation, none of its own set's), and
    the fit they make is written."""
    from tokenizers import Tokenizer

    from chatapp.settings import data_dir

    out = tmp_path / "routed"
    args = ["route", "tiny", "--out", str(out), "--prompts", str(route_prompts), "--layers", "3", "--answer-tokens", "8"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and (out / "routing.json").is_file()
    # The replies the fit learned from (cached by what they depend on): one per conversation of the file.
    (cache,) = (data_dir() / "routing-data").glob("*.json")
    tokenizer = Tokenizer.from_file(str(tiny_model_dir() / "tokenizer.json"))
    texts = [tokenizer.decode(c["ids"]) for c in json.loads(cache.read_text())]
    assert len(texts) == len(ROUTE_PROMPTS)
    for turns in ROUTE_PROMPTS:
        assert sum(all(turn in text for turn in turns) for text in texts) == 1, turns


def test_each_built_in_model_ships_its_prompt_set(tmp_path: Path) -> None:
    """The tiny model's set is in its directory; the default model's in its parts, for a prepared model or a copy;
    a model no recipe made has none."""
    tiny = route_prompts_file(tiny_model_dir())
    assert tiny == tiny_model_dir() / "route_prompts.jsonl" and len(read_dialogues(tiny)) >= 96
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    assert route_prompts_file(prepared) is None
    (prepared / PREPARED_STAMP).write_text("{}\n")
    shipped = route_prompts_file(prepared)
    assert shipped == PARTS_DIR / "route_prompts.jsonl"
    dialogues = read_dialogues(shipped)
    assert len(dialogues) >= 96 and any(len(turns) == 3 for turns in dialogues)  # recall conversations too


def test_the_conversations_are_drawn_by_the_seed(route_prompts: Path) -> None:
    everything = route_dialogues("tiny", tiny_model_dir(), None, 4096, 0)
    assert everything == read_dialogues(tiny_model_dir() / "route_prompts.jsonl")
    drawn = route_dialogues("tiny", tiny_model_dir(), None, 96, 0)
    assert len(drawn) == 96 and all(d in everything for d in drawn)
    assert drawn == route_dialogues("tiny", tiny_model_dir(), None, 96, 0) != route_dialogues(
        "tiny", tiny_model_dir(), None, 96, 1
    )
    assert route_dialogues("tiny", tiny_model_dir(), str(route_prompts), 96, 0) == ROUTE_PROMPTS


def _conversations(*turns: object) -> str:
    return "".join(json.dumps({"messages": [{"role": "user", "content": t}]}) + "\n" for t in turns)


PROMPT_FILES = {
    "missing": (None, "does not exist"),
    "empty": ("\n\n", "holds no conversations"),
    "bad-json": (_conversations("hi") + "{not json\n", ":2: not valid JSON"),
    "no-messages": ('{"prompt": "hi"}\n', ":1: expected an object with a 'messages' list"),
    "no-user-turn": ('{"messages": [{"role": "assistant", "content": "hi"}]}\n', ":1: the conversation has no user"),
    "not-text": (_conversations("hi", ["a", "list"]), ":2: a user turn is not text"),
    "too-few": (_conversations("one", "two", "three"), "holds 3 conversations; a routing fit needs at least 8"),
    "not-utf8": (b"\xff\xfe\n", "not valid UTF-8"),
}


@pytest.mark.parametrize("case", sorted(PROMPT_FILES))
def test_a_bad_prompts_file_is_one_error_and_fix_before_loading(case: str, tmp_path: Path, monkeypatch) -> None:
    import chatapp.models

    monkeypatch.setattr(chatapp.models, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    content, message = PROMPT_FILES[case]
    path = tmp_path / "prompts.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content, encoding="utf-8")
    result = runner.invoke(app, ["route", "tiny", "--out", str(tmp_path / "x"), "--prompts", str(path)])
    assert result.exit_code == 1, result.output
    assert message in result.output and str(path) in " ".join(result.output.split())
    assert result.output.count("error:") == 1 and result.output.count("fix:") == 1, result.output
    assert "Traceback" not in result.output and not (tmp_path / "x").exists()


def test_a_model_without_a_prompt_set_asks_for_one(converted: Path, tmp_path: Path, monkeypatch) -> None:
    import chatapp.models

    monkeypatch.setattr(chatapp.models, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    result = runner.invoke(app, ["route", str(converted), "--out", str(tmp_path / "x")])
    assert result.exit_code == 1, result.output
    output = " ".join(result.output.split())
    assert "has no prompt set of its own" in output and "--prompts prompts.jsonl" in output
    assert "Traceback" not in result.output


def router_config() -> STTConfig:
    """A config whose causal router is small: the fold's tests need only the router."""
    return STTConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        causal_router_hidden_size=8,
    )


@given(st.floats(1e-4, 1 - 1e-4), st.lists(st.floats(-30, 30), min_size=1, max_size=64))
def test_folded_cutoff_decides_as_the_cutoff(cutoff: float, logits: list[float]) -> None:
    """After `fold_cutoff`, a router's probability is >= 0.5 exactly where it was >= the cutoff (away from ties).
    The router's output is made to be each given logit: weights zero, the logit in its bias."""
    config = router_config()
    router = CausalRouter(config).double()
    x = torch.zeros(1, 16, dtype=torch.float64)
    with torch.no_grad():
        router.out.weight.zero_()
        for logit in logits:
            router.out.bias.fill_(logit)
            before = float(torch.sigmoid(router(x, x)))
            fold_cutoff(router, cutoff)
            after = float(torch.sigmoid(router(x, x)))
            if abs(before - cutoff) > 1e-9:
                assert (before >= cutoff) == (after >= 0.5), (logit, before, after)


def test_fold_cutoff_shifts_the_router_bias() -> None:
    config = router_config()
    router = CausalRouter(config)
    x, prev = torch.randn(50, 16), torch.randn(50, 16)
    with torch.no_grad():
        before = torch.sigmoid(router(x, prev))
        cutoff = float(before.median())
        fold_cutoff(router, cutoff)
        after = torch.sigmoid(router(x, prev))
    assert torch.equal(select(before, cutoff), select(after, 0.5))


@given(st.integers(1, 40), st.floats(0.0, 0.95), st.integers(0, 2**31))
def test_a_score_skips_the_lowest_scores_never_the_first(n: int, rate: float, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    score = torch.rand(1, n + 3, generator=generator)
    valid = torch.zeros(1, n + 3, dtype=torch.bool)
    valid[0, :n] = True
    selected = selected_by_score(score, valid, rate)
    skipped = (~selected)[0, :n]
    assert int(skipped.sum()) == min(math.floor(rate * n), n - 1)
    assert selected[0, 0] and selected[0, n:].all()
    if skipped.any() and (~skipped[1:]).any():
        kept_scores = score[0, 1:n][~skipped[1:]]
        assert score[0, :n][skipped].max() <= kept_scores.min()


def test_relayered_model_keeps_the_backbone() -> None:
    """Moving the STT layers changes no dense output: routing off gives the same logits."""
    model = tiny_stt(50, [1])
    moved = with_routed_layers(model, [2, 3], "kv")
    assert moved.stt_layer_indices == [2, 3] and moved.config.skip_mode == "kv"
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        assert torch.equal(model.forward_eval(ids, "off").logits, moved.forward_eval(ids, "off").logits)
        probs = router_probs(moved.model.layers[2], torch.randn(3, 32), torch.randn(3, 32))
    assert probs.shape == (3,)


def test_with_the_prompts_dense_only_the_replies_tokens_are_routable() -> None:
    """A reply's tokens from its first (sampled) one on, forced ones included; none of the prompt's; padding never."""
    prompt, reply = [5, 6, 7, 8], [9, 10, 11, 12, 13]
    forced = [False, True, True, False, False]  # a tool result the engine forced, then the model again
    conv = Conversation(prompt + reply, [False] * 3 + [not f for f in forced], [False] * 8)
    short = Conversation([5, 6, 7], [False, True], [False, False])
    dense = batches([conv, short], pad=0, dense_prompts=True)[0]
    assert dense.routable.tolist() == [[False, False, True] + [False] * 6, [False] * 4 + [True] * 5]
    routed = batches([conv, short], pad=0)[0]
    assert torch.equal(routed.routable, routed.valid)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "tpu", "gpu"])
def test_a_tune_device_this_machine_lacks_is_refused_before_the_fit(device: str) -> None:
    result = runner.invoke(app, ["route", "tiny", "--tune-steps", "2", "--tune-device", device])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"--tune-device {device}" in result.output.replace("'", "") and "fix: use --tune-device cpu" in result.output
