"""The offline LLM on the real default model, against transformers loaded from the same GGUF.

Greedy float32 output must be token-identical to HF `generate` (a) one prompt at a time,
(b) all in one batch, (c) with prefix-cache hits, (d) under preemption, (e) with a long
prompt split by chunked prefill.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.engine.loader.model_store import resolve_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
SYSTEM = "You are a meticulous assistant who answers in one short sentence, citing facts only."
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a primary colour."}],
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How many legs does a spider have?"},
    ],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a dragon who",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_num_seqs=16, kv_cache_memory_bytes=256 << 20)


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    chats = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True)) for c in CHATS]
    return chats + [tok.encode(t) for t in RAW]


@pytest.fixture(scope="module")
def hf_reference(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    transformers = pytest.importorskip("transformers")
    path = resolve_model("smollm2-135m-instruct")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    eos = list(llm.get_tokenizer().eos_token_ids)
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            gen = model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos[0],
            )
            tokens = gen[0, len(ids) :].tolist()
            out.append(tokens)
    return out


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_one_at_a_time(llm, prompt_ids, hf_reference) -> None:
    got = [token_ids(llm.generate({"prompt_token_ids": ids}, greedy()))[0] for ids in prompt_ids]
    assert got == hf_reference


def test_one_batch(llm, prompt_ids, hf_reference) -> None:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], greedy())
    assert token_ids(outputs) == hf_reference
    assert [o.prompt_token_ids for o in outputs] == prompt_ids


def test_prefix_cache_hits(llm, prompt_ids, hf_reference) -> None:
    # CHATS[1] and CHATS[2] share the system prompt; run one, then both.
    llm.generate({"prompt_token_ids": prompt_ids[1]}, greedy())
    outputs = llm.generate([{"prompt_token_ids": prompt_ids[i]} for i in (1, 2)], greedy())
    assert token_ids(outputs) == [hf_reference[1], hf_reference[2]]
    assert outputs[0].num_cached_tokens == (len(prompt_ids[1]) - 1) // 16 * 16
    assert outputs[1].num_cached_tokens >= 32


def test_preemption(prompt_ids, hf_reference) -> None:
    small = LLM(
        dtype="float32",
        max_num_seqs=16,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=8 * 2 * 30 * 3 * 16 * 64 * 4,
    )  # 14 blocks = 224 tokens
    outputs = small.generate([{"prompt_token_ids": ids} for ids in prompt_ids], greedy())
    assert token_ids(outputs) == hf_reference
    assert small.core.stats().num_preemptions > 0
    assert small.core.stats().num_kv_blocks_used == 0


def test_chunked_prefill_of_long_prompt(llm) -> None:
    transformers = pytest.importorskip("transformers")
    tok = llm.get_tokenizer()
    text = " ".join(f"Item {i}: the {i}th entry of a long inventory list." for i in range(60))
    ids = tok.encode(text + " Summary:")
    assert len(ids) > 700
    chunked = LLM(dtype="float32", max_num_batched_tokens=128, kv_cache_memory_bytes=256 << 20)
    got = token_ids(chunked.generate({"prompt_token_ids": ids}, greedy()))[0]
    path = resolve_model("smollm2-135m-instruct")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    eos = list(tok.eos_token_ids)
    with torch.inference_mode():
        want = model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )[0, len(ids) :].tolist()
    assert got == want


def test_capital_of_france(llm) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy())
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"
