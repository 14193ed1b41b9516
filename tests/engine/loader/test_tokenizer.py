"""Tokenizer: built from GGUF metadata (ids equal transformers') and from tokenizer.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.engine.loader.gguf import GGUFFile
from tokenmill.engine.loader.model_store import resolve_model
from tokenmill.engine.loader.tokenizer import Tokenizer


def default_gguf() -> Path:
    """The default model's GGUF in the store (`make test` pulls it first)."""
    return resolve_model("smollm2-135m-instruct")

TEXTS = [
    "Hello, world!",
    "What is the capital of France?",
    "  leading spaces and    runs of spaces\n\n\n\ttabs\r\n",
    "12345 67890 3.14159 1,000,000 2024-06-01 0x1F a1b2c3",
    "def f(x):\n    return {'k': x ** 2}  # comment\n",
    "naïve café — 日本語のテキスト, Ελληνικά, русский",
    "emoji 🤖🎉 and a family 👩\u200d👩\u200d👧 and flags 🇫🇷",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<file_sep>more<jupyter_code>",
    "I'm sure they'll say we've done it, hasn't he?",
    "",
    " ",
    "\x00\x07 control bytes \u200b zero width",
    "x" * 300,
]


# ---- GGUF metadata, small vocabularies ------------------------------------------------


def tiny_metadata(pre: str, **extra: Any) -> dict[str, Any]:
    byte_chars = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]
    tokens = ["<s>", "</s>", "<eot>", *byte_chars, "Ġh", "Ġhe", "12", "<think>"]
    types = [3, 3, 3] + [1] * (len(tokens) - 4) + [4]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["Ġ h", "Ġh e", "1 2"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        **extra,
    }


def test_gguf_tiny_vocab_special_and_user_tokens() -> None:
    metadata = tiny_metadata("gpt2", **{"tokenizer.ggml.eot_token_id": 2})
    tokenizer = Tokenizer.from_gguf(metadata)
    vocab = {t: i for i, t in enumerate(metadata["tokenizer.ggml.tokens"])}
    assert tokenizer.vocab_size == len(vocab)
    assert tokenizer.encode(" he") == [vocab["Ġhe"]]
    assert tokenizer.encode("</s><think> h") == [1, vocab["<think>"], vocab["Ġh"]]
    assert tokenizer.bos_token_id == 0
    assert tokenizer.eos_token_ids == (1, 2)
    # control tokens are special; the user-defined <think> is added but not special
    assert tokenizer.special_token_ids == frozenset({0, 1, 2})
    assert tokenizer.decode([1, vocab["<think>"], vocab["Ġhe"]]) == "<think> he"
    assert tokenizer.decode([1, vocab["Ġhe"]], skip_special_tokens=False) == "</s> he"
    assert tokenizer.convert_ids_to_tokens([vocab["Ġh"], 0]) == ["Ġh", "<s>"]
    assert tokenizer.token_to_id("Ġhe") == vocab["Ġhe"]
    assert tokenizer.id_to_token(vocab["12"]) == "12"
    assert tokenizer.encode("he", add_special_tokens=True) == [vocab["h"], vocab["e"]]


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("gpt2", ["12"]),  # GPT-2 regex keeps "12" together, then the merge applies
        ("smollm", ["1", "2"]),  # digits are split one by one first
        ("llama-bpe", ["12"]),  # \p{N}{1,3}
        ("qwen2", ["1", "2"]),  # \p{N}: one digit per piece
    ],
)
def test_gguf_pre_tokenizer_digit_rules(pre: str, expected: list[str]) -> None:
    tokenizer = Tokenizer.from_gguf(tiny_metadata(pre))
    assert tokenizer.convert_ids_to_tokens(tokenizer.encode("12")) == expected


def test_gguf_add_bos_token_prepends_bos_only_with_special_tokens() -> None:
    tokenizer = Tokenizer.from_gguf(tiny_metadata("gpt2", **{"tokenizer.ggml.add_bos_token": True}))
    assert tokenizer.encode(" h", add_special_tokens=True) == [0, tokenizer.token_to_id("Ġh")]
    assert tokenizer.encode(" h") == [tokenizer.token_to_id("Ġh")]


def test_gguf_unsupported_tokenizers_raise() -> None:
    with pytest.raises(ValueError, match="pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf(tiny_metadata("mystery"))
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        Tokenizer.from_gguf({**tiny_metadata("gpt2"), "tokenizer.ggml.model": "llama"})


def test_gguf_without_template_falls_back_to_chatml() -> None:
    tokenizer = Tokenizer.from_gguf(tiny_metadata("gpt2"))
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# ---- tokenizer.json ---------------------------------------------------------------


def write_tokenizer_json(path: Path) -> dict[str, int]:
    vocab = {
        "<unk>": 0,
        "<s>": 1,
        "</s>": 2,
        "<|eot|>": 3,
        "a": 4,
        "b": 5,
        "ab": 6,
        "Ġ": 7,
        "Ġab": 8,
    }
    backend = HFTokenizer(
        models.BPE(vocab=vocab, merges=[("a", "b"), ("Ġ", "ab")], unk_token="<unk>")
    )
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>", "<|eot|>")]
    )
    backend.save(str(path))
    return vocab


def test_from_file_reads_special_tokens_eos_and_template(tmp_path: Path) -> None:
    vocab = write_tokenizer_json(tmp_path / "tokenizer.json")
    config = {
        "bos_token": {"content": "<s>", "lstrip": False},  # serialized AddedToken form
        "eos_token": "</s>",
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {
                "name": "default",
                "template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}",
            },
        ],
    }
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json", config, extra_eos_token_ids=[3, 2])
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (2, 3)
    assert tokenizer.special_token_ids == frozenset({0, 1, 2, 3})
    assert tokenizer.encode("ab ab</s>") == [vocab["ab"], vocab["Ġab"], 2]
    assert tokenizer.decode([1, 6, 8, 2]) == "ab ab"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_from_file_template_override_and_missing_file(tmp_path: Path) -> None:
    write_tokenizer_json(tmp_path / "tokenizer.json")
    tokenizer = Tokenizer.from_file(
        tmp_path / "tokenizer.json", {}, chat_template="[{{ messages | length }}]"
    )
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}] * 2) == "[2]"
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_ids == ()
    with pytest.raises(FileNotFoundError, match="tokenizer file not found"):
        Tokenizer.from_file(tmp_path / "nope.json")
    json.loads(
        (tmp_path / "tokenizer.json").read_text()
    )  # the written file is a real tokenizer.json


# ---- the default model vs transformers' GGUF tokenizer (slow) --------------------------


@pytest.fixture(scope="module")
def tokenizers_pair() -> tuple[Tokenizer, Any]:
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_gguf(GGUFFile(default_gguf()).metadata)
    theirs = transformers.AutoTokenizer.from_pretrained(
        str(default_gguf().parent), gguf_file=default_gguf().name
    )
    return ours, theirs


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers_and_round_trip(
    tokenizers_pair: tuple[Tokenizer, Any], text: str
) -> None:
    ours, theirs = tokenizers_pair
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == theirs.encode(
        text, add_special_tokens=True
    )
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
def test_special_tokens_equal_transformers(tokenizers_pair: tuple[Tokenizer, Any]) -> None:
    ours, theirs = tokenizers_pair
    assert ours.vocab_size == len(theirs) == 49152
    assert ours.bos_token_id == theirs.bos_token_id == 1
    assert ours.eos_token_ids == (theirs.eos_token_id,) == (2,)
    special = {i for i, token in theirs.added_tokens_decoder.items() if token.special}
    assert ours.special_token_ids == special == set(range(17))
    assert ours.convert_ids_to_tokens([1, 2, 28120]) == theirs.convert_ids_to_tokens([1, 2, 28120])
