"""`chatapp serve` through the official `openai` client (a client no one here wrote), against a server this test
starts over the tiny model: replies equal the engine's own for the same request, streamed or not, with log-probs,
stop strings, samples, schemas, concurrent requests, and OpenAI's error objects for what is wrong."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from chatapp.settings import GenerationSettings

PROMPTS = ["Hi", "What is 2+3?", "Tell me about the sea.", "How many r are in strawberry?"]


def engine_reply(engine, prompt, **settings):
    """The engine's own reply (text, finish reason, the reply fold) to one user turn, alone in its batch."""
    return engine.generate_batch([prompt], GenerationSettings(**settings))[0]


def raw_post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def chat(client, prompt, **options):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], **options)


def test_models_lists_the_served_model(served) -> None:
    models = served.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert served.client().models.retrieve("tiny").id == "tiny"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_greedy_reply_is_the_engines_streamed_or_not(served, prompt) -> None:
    expected = engine_reply(served.engine, prompt, max_tokens=40)
    client = served.client()
    whole = chat(client, prompt, max_tokens=40, temperature=0)
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == {"stop": "stop", "length": "length"}[expected.finish_reason]
    assert whole.usage.completion_tokens == len(expected.tokens)
    assert whole.usage.prompt_tokens == len(served.engine._prompt_ids(prompt))

    chunks = list(chat(client, prompt, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_the_calculator_runs_inside_the_server(served) -> None:
    """Its call and result are part of the text, as `chatapp generate` prints them; the extension marks the
    result's tokens forced."""
    expected = engine_reply(served.engine, "What is 2+3?", max_tokens=40)
    assert expected.tool_calls, "the tiny model calls the calculator for this prompt"
    reply = chat(served.client(), "What is 2+3?", max_tokens=40, temperature=0, extra_body={"chatapp": {"tokens": True}})
    choice = reply.choices[0]
    assert choice.message.content == expected.text
    tokens = choice.model_extra["chatapp"]["tokens"]
    assert [t["id"] for t in tokens] == [e.token for e in expected.events]  # the final stop token too
    assert [t["forced"] for t in tokens] == [e.forced for e in expected.events]
    assert any(t["forced"] for t in tokens) and any(t["tool"] for t in tokens)
    assert all(len(t["computed"]) == len(served.engine.stt_layers) for t in tokens)
    assert tokens[-1]["finish_reason"] == expected.finish_reason
    assert choice.model_extra["chatapp"]["finish"]["forced_tokens"] == sum(expected.forced)


def test_the_extension_field_is_sent_only_when_asked(served) -> None:
    reply = chat(served.client(), "Hi", max_tokens=5, temperature=0)
    assert "chatapp" not in (reply.choices[0].model_extra or {})


def test_logprobs_are_the_engines(served) -> None:
    expected = engine_reply(served.engine, "Hi", max_tokens=12, logprobs=3)
    reply = chat(served.client(), "Hi", max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    lps = [e.logprobs for e in expected.events if e.finish_reason != "stop"]
    assert [entry.logprob for entry in content] == pytest.approx([lp.logprob for lp in lps], abs=1e-6)
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    assert [entry.top_logprobs[0].logprob for entry in content] == pytest.approx([lp.top[0].logprob for lp in lps])
    plain = chat(served.client(), "Hi", max_tokens=3, temperature=0, logprobs=True)
    assert all(entry.top_logprobs == [] for entry in plain.choices[0].logprobs.content)


def test_json_schema_holds_the_reply_to_the_schema(served) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    reply = chat(
        served.client(),
        "Is the sea blue?",
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}},
    )
    value = json.loads(reply.choices[0].message.content)
    assert value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)
    assert reply.choices[0].finish_reason == "stop"


def test_json_object_is_a_json_object(served) -> None:
    reply = chat(served.client(), "Give me JSON.", max_tokens=80, temperature=0, response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].message.content.lstrip().startswith("{")


def test_stop_strings_cut_the_reply_before_them_streamed_or_not(served) -> None:
    expected = engine_reply(served.engine, "Tell me about the sea.", max_tokens=40).text
    assert len(expected) > 12
    stop = expected[6:10]
    cut = expected[: expected.find(stop)]
    client = served.client()
    whole = chat(client, "Tell me about the sea.", max_tokens=40, temperature=0, stop=[stop, "never seen"])
    assert whole.choices[0].message.content == cut and whole.choices[0].finish_reason == "stop"
    chunks = list(chat(client, "Tell me about the sea.", max_tokens=40, temperature=0, stop=stop, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(deltas) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_samples_are_the_engines_samples(served) -> None:
    replies = served.engine.generate_batch(
        ["Hi"], GenerationSettings(temperature=1.0, top_p=0.9, seed=11, max_tokens=10), num_samples=3
    )
    reply = chat(served.client(), "Hi", max_tokens=10, temperature=1.0, top_p=0.9, seed=11, n=3)
    assert [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)] == [r.text for r in replies]


def test_completions_answer_a_plain_prompt(served) -> None:
    engine = served.engine
    ids = [engine.chat_format.bos_id, *engine.chat_format.encode_text("The sea is")]
    expected = engine.generate_batch([ids], GenerationSettings(max_tokens=10))[0]
    client = served.client()
    whole = client.completions.create(model="tiny", prompt="The sea is", max_tokens=10, temperature=0, logprobs=2)
    assert whole.choices[0].text == expected.text
    assert len(whole.choices[0].logprobs.token_logprobs) == whole.usage.completion_tokens
    streamed = client.completions.create(model="tiny", prompt="The sea is", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text


def test_concurrent_requests_each_get_their_own_reply(served) -> None:
    prompts = [f"{p} {i}" for i in range(3) for p in PROMPTS]
    expected = [engine_reply(served.engine, p, max_tokens=24).text for p in prompts]
    client = served.client()

    def ask(prompt: str) -> str:
        stream = chat(client, prompt, max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(ask, prompts)) == expected


# ------------------------------------------------------------------------------------------------------ errors
def assert_error(err: openai.APIStatusError, status: int, param: str | None, *words: str) -> None:
    assert err.status_code == status
    body = err.body
    assert set(body) == {"message", "type", "param", "code"}
    assert body["param"] == param
    for word in words:
        assert word in body["message"]


@pytest.mark.parametrize(
    ("options", "param", "word"),
    [
        ({"temperature": 5}, "temperature", "between 0"),
        ({"max_tokens": 0}, "max_tokens", "between 1"),
        ({"n": 0}, "n", "between 1"),
        ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
        ({"frequency_penalty": "a lot"}, "frequency_penalty", "must be a number"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "> 0"),
        ({"extra_body": {"dry_sequence_breakers": "\n"}}, "dry_sequence_breakers", "list of non-empty strings"),
        ({"extra_body": {"repeat_last_n": -2}}, "repeat_last_n", "between -1"),
        ({"extra_body": {"logit_bias": {"1": 5}}}, "logit_bias", "does not support"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format",
            "",
        ),
        ({"extra_body": {"best_of": 3}}, "best_of", "does not support"),
        ({"extra_body": {"colour": "red"}}, "colour", "unknown field"),
    ],
)
def test_bad_values_get_400_naming_the_field(served, options, param, word) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(served.client(), "Hi", **options)
    assert_error(caught.value, 400, param, word)


def test_neutral_values_of_unsupported_fields_are_taken(served) -> None:
    reply = chat(served.client(), "Hi", max_tokens=3, presence_penalty=0, frequency_penalty=0, logit_bias={})
    assert reply.choices[0].message.content is not None


def test_samplers_take_the_settings_names_and_answer_as_the_engine_does(served) -> None:
    """OpenAI's penalties, and llama.cpp's and vLLM's sampler fields through `extra_body`, reach the engine: the
    served greedy reply equals the engine's own with the same settings."""
    from chatapp.settings import GenerationSettings

    samplers = {"presence_penalty": 0.6, "frequency_penalty": 0.3}
    extra = {"repetition_penalty": 1.3, "repeat_last_n": 16, "dry_multiplier": 0.8, "dry_allowed_length": 1,
             "min_p": 0.05, "dry_sequence_breakers": ["\n"]}
    reply = chat(served.client(), "Tell me more", max_tokens=12, temperature=0, seed=1, extra_body=extra, **samplers)
    engine = served.engine
    ids = engine.chat_format.render_for_completion([{"role": "user", "content": "Tell me more"}])
    settings = GenerationSettings(max_tokens=12, seed=1, temperature=0.0).with_(
        **samplers, **{k: tuple(v) if isinstance(v, list) else v for k, v in extra.items()}
    )
    alone = engine.generate_batch([ids], engine.default_settings(settings, {*samplers, *extra, "temperature"}))[0]
    assert reply.choices[0].message.content == alone.text


def test_a_prompt_over_the_context_gets_400_naming_the_limit(served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        chat(served.client(), "word " * 400)
    assert_error(caught.value, 400, "messages", "256")
    assert caught.value.body["code"] == "context_length_exceeded"


def test_an_unknown_model_gets_404(served) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        served.client().chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    assert_error(caught.value, 404, "model", "gpt-9", "tiny")


def test_bad_conversations_get_400(served) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        served.client().chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "Hi"}])
    assert caught.value.status_code == 400


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"messages": "Hi"}', 400, "invalid_value"),
    ],
    ids=["not-json", "not-an-object", "messages-a-string"],
)
def test_malformed_bodies_get_error_objects(served, body, status, code) -> None:
    got, answer = raw_post(f"{served.url}/chat/completions", body)
    assert got == status and answer["error"]["code"] == code


def test_a_body_over_the_limit_gets_413_before_it_is_read(served) -> None:
    connection = http.client.HTTPConnection(served.url.split("//")[1].split("/")[0], timeout=30)
    connection.putrequest("POST", "/v1/chat/completions")
    connection.putheader("Content-Type", "application/json")
    connection.putheader("Content-Length", str(5 << 20))
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413 and json.loads(response.read())["error"]["code"] == "too_large"
    connection.close()


def test_unknown_paths_get_404_error_objects(served) -> None:
    got, answer = raw_post(f"{served.url}/embeddings", b"{}")
    assert got == 404 and set(answer["error"]) == {"message", "type", "param", "code"}


def test_a_key_is_required_when_the_server_has_one(serve_with) -> None:
    with serve_with(api_key="sesame") as server:
        with pytest.raises(openai.AuthenticationError) as caught:
            chat(server.client(api_key="wrong"), "Hi", max_tokens=2)
        assert caught.value.status_code == 401
        assert chat(server.client(api_key="sesame"), "Hi", max_tokens=2).choices


def test_a_full_queue_gets_429(serve_with) -> None:
    with serve_with(max_rows=1, max_queue=0) as server:
        client = server.client()
        running = chat(client, "Tell me about the sea.", temperature=2.0, seed=1, stream=True)
        next(iter(running))  # admitted: it holds the one row
        with pytest.raises(openai.RateLimitError) as caught:
            chat(client, "Hi", max_tokens=2)
        assert_error(caught.value, 429, None, "busy")
        running.close()


def test_a_client_that_hangs_up_frees_its_row_at_once(served) -> None:
    """A reply that would run to the end of the context (temperature 2 rarely stops) is dropped from the batch
    within a few steps of its client closing the connection, and a concurrent reply is unchanged."""
    client = served.client()
    expected = engine_reply(served.engine, "Hi", max_tokens=30).text
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(lambda: chat(client, "Hi", max_tokens=30, temperature=0).choices[0].message.content)
        stream = chat(client, "Tell me about the sea.", temperature=2.0, seed=3, stream=True)
        chunks = iter(stream)
        for _ in range(3):
            next(chunks)
        stream.close()
        gone = time.monotonic()
        while served.server.engine_loop.load[0] > (0 if other.done() else 1):
            assert time.monotonic() - gone < 1.0, "the row was not freed"
            time.sleep(0.01)
        assert other.result() == expected
