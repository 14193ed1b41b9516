from pathlib import Path

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.loader.gguf import GGUFFile
from tokenmill.engine.loader.model_store import resolve_model
from tokenmill.engine.loader.tokenizer import Tokenizer


def default_gguf() -> Path:
    """The default model's GGUF in the store (`make test` pulls it first)."""
    return resolve_model("smollm2-135m-instruct")

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    " 👩\u200d👩\u200d👧 and 🇫🇷 🤖🎉",
    "naïve café — crème brûlée, Ελληνικά, русский",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "def f(x):\n    return {'k': x ** 2}  # ünïcödé\n",
    "mixed😀日本a\u0301e\u0300 end",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(default_gguf()).metadata)


def stream(tokenizer: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    return [detokenizer.decode_next(t) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode_without_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, [], ids)
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_texts_do_split_characters_across_tokens(tokenizer):
    # The cases above exercise splits: some tokens alone decode to partial UTF-8.
    split = [
        t
        for text in TEXTS[1:4]
        for t in tokenizer.encode(text)
        if "\ufffd" in tokenizer.decode([t])
    ]
    assert len(split) > 10


def test_prompt_context_continues_the_text(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\nSure:")
    output = tokenizer.encode(" hi 😀 there")
    deltas = stream(tokenizer, prompt, output)
    full = tokenizer.decode(prompt + output, skip_special_tokens=True)
    assert "".join(deltas) == full[len(tokenizer.decode(prompt, skip_special_tokens=True)) :]
    assert "".join(deltas) == " hi 😀 there"


def test_a_prompt_ending_mid_character_is_finished_by_the_output(tokenizer):
    ids = tokenizer.encode("ab 😀 cd")
    cut = next(i for i in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:i]))
    deltas = stream(tokenizer, ids[:cut], ids[cut:])
    assert all("\ufffd" not in d for d in deltas)
    # The character is emitted whole, with the space its first (prompt) token carried.
    assert "".join(deltas) == " 😀 cd"
    assert tokenizer.decode(ids[: cut - 1]) + "".join(deltas) == "ab 😀 cd"


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi<|im_end|>there")
    assert "".join(stream(tokenizer, [], ids, skip=True)) == "Hithere"
    assert "".join(stream(tokenizer, [], ids, skip=False)) == "Hi<|im_end|>there"


def test_decode_many_counts_tokens(tokenizer):
    ids = tokenizer.encode("日本語 and more")
    detokenizer = IncrementalDetokenizer(tokenizer, [1])
    first = detokenizer.decode(ids[:2])
    assert first + detokenizer.decode(ids[2:]) == "日本語 and more"
    assert detokenizer.num_tokens == len(ids)
