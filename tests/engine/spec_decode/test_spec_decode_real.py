"""Speculative decoding on the real default model (float32, so greedy is stable): a
copying prompt and free prompts give the same tokens with n-gram and with the self-draft
as without, and copying accepts most drafts."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "A module can contain executable statements as well as function definitions. These "
    "statements are intended to initialize the module. They are executed only the first "
    "time the module name is encountered in an import statement."
)
CHATS = [
    [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PARAGRAPH}"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List the first ten prime numbers."}],
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "self-draft": {"method": "draft", "model": "self", "num_layers": 12, "num_speculative_tokens": 3, "adaptive": False},
}


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    return [o.outputs[0].token_ids for o in llm.chat(CHATS, GREEDY)]


@pytest.mark.parametrize("name", list(SPECS))
def test_same_tokens_as_without_speculation(reference, name) -> None:
    llm = LLM(
        dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=64 << 20, max_model_len=1024,
        speculative=SPECS[name],
    )
    outputs = llm.chat(CHATS, GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    stats = llm.core.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    kv = llm.core.scheduler.kv_cache
    assert kv.num_free_blocks == kv.num_blocks


def test_copying_accepts_most_ngram_drafts(reference) -> None:
    llm = LLM(
        dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=64 << 20, max_model_len=1024,
        speculative={"method": "ngram", "num_speculative_tokens": 4},
    )
    (output,) = llm.chat(CHATS[:1], GREEDY)
    assert output.outputs[0].token_ids == reference[0]
    stats = llm.core.stats()
    assert stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens > 0.7
    # Fewer than half as many engine steps as tokens: most arrive as accepted drafts.
    assert stats.num_steps <= len(reference[0]) // 2


def test_stop_strings_cut_the_same_text() -> None:
    """A stop string inside a span of accepted drafts: the text ends before it, as without
    speculation (the stop checker works on the text, whatever arrives per step)."""
    params = SamplingParams(temperature=0.0, max_tokens=64, stop=["initialize"])
    outputs = {}
    for name, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        llm = LLM(dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=64 << 20, max_model_len=1024, speculative=spec)
        (output,) = llm.chat(CHATS[:1], params)
        outputs[name] = (output.outputs[0].text, output.outputs[0].finish_reason, output.outputs[0].stop_reason)
    assert outputs["ngram"] == outputs["plain"]
    assert outputs["plain"][1:] == ("stop", "initialize")
