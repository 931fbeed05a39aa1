"""Chat formats: exact token layout and loss mask, typed special-token text, completion prompts, Jinja templates."""

from __future__ import annotations

import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.chat import CHAT_TOKENS, ChatFormat, TemplateChatFormat, chat_format_for, parse_messages
from chatapp.errors import ConversationError, ModelDirError
from chatapp.recipes.tiny.tokenizer import CHAT_SPECIAL_TOKENS, train_bpe_tokenizer
from tests.conftest import SAMPLE_TEXT

TOOL_CONVERSATION = [
    {"role": "user", "content": "What is 37*45?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me compute that. "},
            {"type": "python", "text": "37*45"},
            {"type": "python_output", "text": "1665"},
            {"type": "text", "text": "37*45 is 1665."},
        ],
    },
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]


@pytest.fixture(scope="module")
def fmt(chat_tokenizer) -> ChatFormat:
    return ChatFormat(chat_tokenizer)


def test_chat_token_names_match_the_tokenizer_trainer():
    assert tuple(CHAT_TOKENS.values()) == CHAT_SPECIAL_TOKENS


def test_tool_conversation_ids_and_loss_mask_are_exact(fmt: ChatFormat):
    ids, mask = fmt.render_conversation(TOOL_CONVERSATION)
    enc = fmt.encode_text
    pieces = [
        ([fmt.bos_id], 0),
        ([fmt.user_start_id], 0),
        (enc("What is 37*45?"), 0),
        ([fmt.user_end_id], 0),
        ([fmt.assistant_start_id], 0),
        (enc("Let me compute that. "), 1),
        ([fmt.python_start_id], 1),
        (enc("37*45"), 1),
        ([fmt.python_end_id], 1),
        ([fmt.output_start_id], 0),
        (enc("1665"), 0),
        ([fmt.output_end_id], 0),
        (enc("37*45 is 1665."), 1),
        ([fmt.assistant_end_id], 1),
        ([fmt.user_start_id], 0),
        (enc("Thanks!"), 0),
        ([fmt.user_end_id], 0),
        ([fmt.assistant_start_id], 0),
        (enc("You are welcome."), 1),
        ([fmt.assistant_end_id], 1),
    ]
    assert ids == [i for part, _ in pieces for i in part]
    assert mask == [m for part, m in pieces for _ in part]


def test_decode_of_render_reproduces_the_conversation_text(fmt: ChatFormat):
    ids, _ = fmt.render_conversation(TOOL_CONVERSATION)
    assert fmt.decode(ids) == (
        "<|bos|><|user_start|>What is 37*45?<|user_end|>"
        "<|assistant_start|>Let me compute that. <|python_start|>37*45<|python_end|>"
        "<|output_start|>1665<|output_end|>37*45 is 1665.<|assistant_end|>"
        "<|user_start|>Thanks!<|user_end|><|assistant_start|>You are welcome.<|assistant_end|>"
    )


def test_supervised_tokens_are_exactly_what_the_model_writes(fmt: ChatFormat):
    ids, mask = fmt.render_conversation(TOOL_CONVERSATION)
    supervised = fmt.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert supervised == (
        "Let me compute that. <|python_start|>37*45<|python_end|>37*45 is 1665.<|assistant_end|>"
        "You are welcome.<|assistant_end|>"
    )


def test_system_message_is_merged_into_the_first_user_message(fmt: ChatFormat):
    with_system = [{"role": "system", "content": "Be brief."}, *TOOL_CONVERSATION]
    merged = [{"role": "user", "content": "Be brief.\n\nWhat is 37*45?"}, *TOOL_CONVERSATION[1:]]
    assert fmt.render_conversation(with_system) == fmt.render_conversation(merged)


def test_max_tokens_truncates_ids_and_mask_together(fmt: ChatFormat):
    ids, mask = fmt.render_conversation(TOOL_CONVERSATION)
    short_ids, short_mask = fmt.render_conversation(TOOL_CONVERSATION, max_tokens=7)
    assert (short_ids, short_mask) == (ids[:7], mask[:7])


@pytest.mark.parametrize("typed", [*CHAT_SPECIAL_TOKENS, "<|assistant_end|><|bos|>", "x<|python_start|>1+1"])
def test_typed_special_token_text_stays_ordinary_text(fmt: ChatFormat, typed: str):
    ids, _ = fmt.render_conversation([{"role": "user", "content": typed}])
    body = ids[2:-1]  # between <|user_start|> and <|user_end|>
    assert not set(body) & {*fmt.stop_token_ids, fmt.user_end_id, fmt.python_start_id, fmt.output_start_id}
    assert all(i >= len(CHAT_SPECIAL_TOKENS) for i in body)
    assert fmt.decode(body) == typed
    # The shared tokenizer is untouched: it still reads the names as specials.
    assert fmt.tokenizer.encode("<|assistant_end|>", add_special_tokens=False).ids == [fmt.assistant_end_id]


@given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from(CHAT_SPECIAL_TOKENS)), max_size=6))
def test_encode_text_round_trips_and_never_emits_chat_tokens(chat_tokenizer, pieces: list[str]):
    fmt = _shared_format(chat_tokenizer)
    text = "".join(pieces)
    ids = fmt.encode_text(text)
    assert fmt.decode(ids) == text
    assert min(ids, default=len(CHAT_SPECIAL_TOKENS)) >= len(CHAT_SPECIAL_TOKENS)


@given(st.lists(st.one_of(st.text(max_size=12), st.sampled_from([*CHAT_SPECIAL_TOKENS, "<think>"])), max_size=6))
def test_encode_text_is_the_private_copys_encoding_with_or_without_it(chat_tokenizer, pieces: list[str]):
    """The private copy that keeps special-token names as text is made only for a text holding one: every other
    text goes through the shared tokenizer, and must come out the same as through the copy."""
    from chatapp.chat.messages import TokenizerText, _text_tokenizer

    text = "".join(pieces)
    for structural in (set(CHAT_TOKENS.values()), None):
        oracle = _text_tokenizer(chat_tokenizer, structural).encode(text, add_special_tokens=False).ids
        assert TokenizerText(chat_tokenizer, structural).encode_text(text) == oracle


def test_the_private_copy_is_made_only_for_a_text_that_needs_it(chat_tokenizer):
    from chatapp.chat.messages import TokenizerText

    text = TokenizerText(chat_tokenizer, set(CHAT_TOKENS.values()))
    text.encode_text("What is 2+2? Tell me plainly.")
    assert text._encoder is None
    text.encode_text("say <|assistant_end|> please")
    assert text._encoder is not None


_FORMATS: dict[int, ChatFormat] = {}


def _shared_format(tokenizer) -> ChatFormat:
    """One format per tokenizer across Hypothesis examples (building one copies the tokenizer)."""
    return _FORMATS.setdefault(id(tokenizer), ChatFormat(tokenizer))


_content = st.lists(st.one_of(st.text(max_size=8), st.sampled_from(CHAT_SPECIAL_TOKENS)), max_size=3).map("".join)
_assistant_parts = st.lists(
    st.builds(
        lambda kind, text: {"type": kind, "text": text}, st.sampled_from(["text", "python", "python_output"]), _content
    ),
    min_size=1,
    max_size=4,
)
_conversations = st.lists(st.tuples(_content, st.one_of(_content, _assistant_parts)), min_size=1, max_size=3)


@given(_conversations)
def test_render_matches_an_independent_rendering_of_random_conversations(chat_tokenizer, exchanges):
    """Oracle: the conversation written out as text by hand, and the supervised part of it."""
    fmt = _shared_format(chat_tokenizer)
    messages, text, supervised = [], "<|bos|>", ""
    for user, answer in exchanges:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        text += f"<|user_start|>{user}<|user_end|><|assistant_start|>"
        for part in [{"type": "text", "text": answer}] if isinstance(answer, str) else answer:
            written = {
                "text": part["text"],
                "python": f"<|python_start|>{part['text']}<|python_end|>",
                "python_output": f"<|output_start|>{part['text']}<|output_end|>",
            }[part["type"]]
            text += written
            supervised += "" if part["type"] == "python_output" else written
        text += "<|assistant_end|>"
        supervised += "<|assistant_end|>"
    ids, mask = fmt.render_conversation(messages)
    assert len(ids) == len(mask)
    assert fmt.decode(ids) == text
    assert fmt.decode([i for i, m in zip(ids, mask, strict=True) if m]) == supervised
    # Structural ids appear exactly where the format put them, never from content.
    assert ids.count(fmt.assistant_end_id) == len(exchanges) == ids.count(fmt.user_start_id)


def test_non_chat_added_tokens_are_content_vocabulary():
    tok = train_bpe_tokenizer([SAMPLE_TEXT] * 5, 320, special_tokens=(*CHAT_SPECIAL_TOKENS, "<think>", "</think>"))
    fmt = ChatFormat(tok)
    think, end_think = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    ids = fmt.encode_text("<think>hmm</think>Paris.<|assistant_end|>")
    assert ids[0] == think and end_think in ids
    assert fmt.assistant_end_id not in ids


def test_completion_prompt_ends_with_assistant_start_and_drops_a_trailing_answer(fmt: ChatFormat):
    prompt = fmt.render_for_completion(TOOL_CONVERSATION)
    assert prompt[-1] == fmt.assistant_start_id
    assert prompt == fmt.render_for_completion(TOOL_CONVERSATION[:3])
    # Prefix-stable: a chat session can prefill only the new turn.
    full, _ = fmt.render_conversation(TOOL_CONVERSATION)
    assert full[: len(prompt)] == prompt
    first = fmt.render_for_completion(TOOL_CONVERSATION[:1])
    assert full[: len(first)] == first
    assert fmt.decode(first) == "<|bos|><|user_start|>What is 37*45?<|user_end|><|assistant_start|>"


def test_stop_tokens_are_assistant_end_and_bos(fmt: ChatFormat):
    assert fmt.stop_token_ids == (fmt.assistant_end_id, fmt.bos_id)
    assert fmt.supports_tools


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([{"role": "assistant", "content": "hi"}], "message 0 is from 'assistant'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "message 1 is from 'user'"),
        ([{"role": "robot", "content": "a"}], "role 'robot'"),
        ([{"role": "user", "content": ["x"]}], "must be a string"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "sql"}]}], "part 0"),
        ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "message 1 is from 'system'"),
        ("hello", "list of messages"),
    ],
)
def test_malformed_conversations_name_the_message(fmt: ChatFormat, messages, needle: str):
    with pytest.raises(ConversationError, match=needle):
        fmt.render_conversation(messages)


def test_completion_needs_a_user_message(fmt: ChatFormat):
    with pytest.raises(ConversationError, match="user message"):
        fmt.render_for_completion([])
    with pytest.raises(ConversationError, match="user message"):
        fmt.render_for_completion([{"role": "system", "content": "x"}])
    with pytest.raises(ConversationError, match="followed by a user"):
        fmt.render_conversation([{"role": "system", "content": "x"}])


def test_parse_messages_turns_strings_into_one_text_part():
    (turn,) = parse_messages([{"role": "user", "content": "hi"}])
    assert (turn.role, turn.text, turn.parts[0].type) == ("user", "hi", "text")


def test_formats_are_safe_to_share_between_threads(fmt: ChatFormat):
    texts = [f"<|assistant_end|> {i} strawberry <|bos|>" * (1 + i % 5) for i in range(64)]
    expected = [fmt.encode_text(t) for t in texts]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(fmt.encode_text, texts * 8))
    assert results == expected * 8
    assert fmt.tokenizer.encode_special_tokens is False


def test_chat_format_needs_the_chat_tokens():
    tok = train_bpe_tokenizer([SAMPLE_TEXT], 300, special_tokens=("<|endoftext|>",))
    with pytest.raises(ModelDirError, match="<\\|user_start\\|>"):
        ChatFormat(tok)


# --- Jinja chat templates (Qwen style) ---------------------------------------------------------------------------

QWEN_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
# Like Qwen3's: earlier assistant turns lose their <think> block, so contents are not written verbatim.
REWRITING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- set content = message.content.split('</think>')[-1] if message.role == 'assistant' else message.content %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And 37*45?"},
]


@pytest.fixture(scope="module")
def qwen_tokenizer():
    # Whitespace runs in the corpus give it merges such as "\n \n", as real tokenizers have.
    texts = [SAMPLE_TEXT, "a\n \nb\n\n\nab \n \t\n  a'. é\n\n"] * 20
    return train_bpe_tokenizer(texts, vocab_size=400, special_tokens=QWEN_SPECIALS)


def _checkpoint(tmp_path: Path, tokenizer, template: str, *, generation_eos: list[int] | None = None) -> Path:
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": template, "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return tmp_path


def test_template_ids_match_transformers_apply_chat_template(tmp_path: Path, qwen_tokenizer):
    from transformers import PreTrainedTokenizerFast

    fmt = chat_format_for(qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, QWEN_TEMPLATE))
    assert isinstance(fmt, TemplateChatFormat)
    hf = PreTrainedTokenizerFast(tokenizer_object=qwen_tokenizer, chat_template=QWEN_TEMPLATE)
    expected = hf.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, Mapping) else expected
    assert fmt.render_for_completion(CONVERSATION) == list(expected)
    without_system = CONVERSATION[1:]
    text = hf.apply_chat_template(without_system, tokenize=False, add_generation_prompt=True)
    assert fmt.decode(fmt.render_for_completion(without_system)) == text


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory, qwen_tokenizer):
    """Our template format and transformers' tokenizer over the same tokenizer and template."""
    from transformers import PreTrainedTokenizerFast

    model_dir = _checkpoint(tmp_path_factory.mktemp("qwen"), qwen_tokenizer, QWEN_TEMPLATE)
    hf = PreTrainedTokenizerFast(tokenizer_object=qwen_tokenizer, chat_template=QWEN_TEMPLATE)
    return chat_format_for(qwen_tokenizer, model_dir), hf


# Whitespace at content edges is where encoding pieces apart would differ from encoding the whole string.
_plain = st.text(alphabet=st.sampled_from(list("ab \n\t'.é")), max_size=10)


@given(st.lists(_plain, min_size=1, max_size=4), st.booleans())
@settings(max_examples=60)
def test_template_ids_match_transformers_on_random_contents(qwen_pair, contents: list[str], system: bool):
    fmt, hf = qwen_pair
    roles = ["user", "assistant"] * 2
    messages = [{"role": role, "content": text} for role, text in zip(roles, contents, strict=False)]
    if system:
        messages.insert(0, {"role": "system", "content": "Be brief."})
    expected = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, Mapping) else expected
    if messages[-1]["role"] == "user":
        assert fmt.render_for_completion(messages) == list(expected)
    ids, mask = fmt.render_conversation(messages)
    plain = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    assert ids == list(plain["input_ids"] if isinstance(plain, Mapping) else plain)
    assert len(mask) == len(ids)


def test_template_keeps_typed_special_tokens_as_text(tmp_path: Path, qwen_tokenizer):
    fmt = chat_format_for(qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, QWEN_TEMPLATE))
    im_end = qwen_tokenizer.token_to_id("<|im_end|>")
    plain = fmt.render_for_completion([{"role": "user", "content": "hi"}])
    typed = fmt.render_for_completion([{"role": "user", "content": "hi<|im_end|>"}])
    assert typed.count(im_end) == plain.count(im_end)
    assert fmt.decode(typed).count("<|im_end|>") == fmt.decode(plain).count("<|im_end|>") + 1


def test_template_loss_mask_covers_assistant_content_and_its_closing_token(tmp_path: Path, qwen_tokenizer):
    fmt = chat_format_for(qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, QWEN_TEMPLATE))
    conversation = [*CONVERSATION, {"role": "assistant", "content": "1665."}]
    ids, mask = fmt.render_conversation(conversation)
    assert len(ids) == len(mask)
    assert fmt.decode([i for i, m in zip(ids, mask, strict=True) if m]) == "Paris.<|im_end|>1665.<|im_end|>"
    assert fmt.decode(ids).endswith("<|im_start|>assistant\n1665.<|im_end|>\n")


def test_template_stop_tokens_and_attributes(tmp_path: Path, qwen_tokenizer):
    endoftext = qwen_tokenizer.token_to_id("<|endoftext|>")
    im_end = qwen_tokenizer.token_to_id("<|im_end|>")
    fmt = TemplateChatFormat.from_dir(
        qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, QWEN_TEMPLATE, generation_eos=[im_end, endoftext])
    )
    assert fmt.stop_token_ids == (im_end, endoftext)
    assert fmt.assistant_end_id == im_end
    assert fmt.bos_id is None and fmt.python_start_id is None and not fmt.supports_tools


def test_template_from_chat_template_jinja_file_and_without_eos(tmp_path: Path, qwen_tokenizer):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    fmt = chat_format_for(qwen_tokenizer, tmp_path)
    # No eos anywhere: the token the template closes assistant turns with is still found.
    assert fmt.stop_token_ids == (qwen_tokenizer.token_to_id("<|im_end|>"),)


def test_template_that_rewrites_contents(tmp_path: Path, qwen_tokenizer):
    fmt = chat_format_for(qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, REWRITING_TEMPLATE))
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet</think>Hello."},
        {"role": "user", "content": "Bye"},
    ]
    prompt = fmt.decode(fmt.render_for_completion(history))
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n" + (
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(ConversationError, match="loss mask"):
        fmt.render_conversation(history)
    with pytest.raises(ConversationError, match="<\\|im_end\\|>"):
        fmt.render_for_completion([*history[:2], {"role": "user", "content": "x<|im_end|>"}])


def test_template_rejects_tool_parts(tmp_path: Path, qwen_tokenizer):
    fmt = chat_format_for(qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, QWEN_TEMPLATE))
    with pytest.raises(ConversationError, match="tool call"):
        fmt.render_conversation(TOOL_CONVERSATION)


def test_template_errors_become_clear_errors(tmp_path: Path, qwen_tokenizer):
    refusing = "{{ raise_exception('roles must alternate') }}"
    fmt = chat_format_for(qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, refusing))
    with pytest.raises(ConversationError, match="roles must alternate"):
        fmt.render_for_completion([{"role": "user", "content": "hi"}])
    with pytest.raises(ModelDirError, match="not valid Jinja"):
        chat_format_for(qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, "{% for %}"))
    (tmp_path / "generation_config.json").write_text("{broken")
    with pytest.raises(ModelDirError, match=r"generation_config\.json"):
        chat_format_for(qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, QWEN_TEMPLATE))


def test_sandbox_blocks_attribute_escapes(tmp_path: Path, qwen_tokenizer):
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    fmt = chat_format_for(qwen_tokenizer, _checkpoint(tmp_path, qwen_tokenizer, escape))
    with pytest.raises(ConversationError):
        fmt.render_for_completion([{"role": "user", "content": "hi"}])


def test_chat_format_for_picks_nanochat_format_first(tmp_path: Path, chat_tokenizer):
    assert isinstance(chat_format_for(chat_tokenizer, _checkpoint(tmp_path, chat_tokenizer, QWEN_TEMPLATE)), ChatFormat)


def test_chat_format_for_without_tokens_or_template(tmp_path: Path, qwen_tokenizer):
    with pytest.raises(ModelDirError, match="no chat template") as info:
        chat_format_for(qwen_tokenizer, tmp_path)
    assert str(tmp_path) in info.value.message and info.value.hint
