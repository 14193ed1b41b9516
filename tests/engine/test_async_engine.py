"""AsyncEngine on the real default model: streaming, concurrency, aborts, validation."""

from __future__ import annotations

import asyncio

import pytest

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.request import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine.from_args(dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=128 << 20)
    yield eng
    asyncio.run(eng.shutdown())


def run(coro):
    return asyncio.run(coro)


async def collect(engine: AsyncEngine, prompt, params: SamplingParams, rid: str):
    await engine.start()
    deltas = [d async for d in engine.generate(prompt, params, rid)]
    return deltas


def test_stream_concatenates_to_the_whole_answer(engine: AsyncEngine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    deltas = run(collect(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30), "s1"))
    assert len(deltas) > 3  # streamed, not one blob
    text = "".join(d.outputs[0].text for d in deltas if d.outputs)
    assert text == "The capital of France is Paris."
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "stop"
    assert all(not d.finished for d in deltas[:-1])


def test_concurrent_requests_and_n(engine: AsyncEngine) -> None:
    async def main():
        await engine.start()
        params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, n=2)
        results = await asyncio.gather(
            *(collect(engine, f"Story {i}:", params, f"c{i}") for i in range(6))
        )
        return results

    results = run(main())
    for deltas in results:
        assert deltas[-1].finished
        per_index: dict[int, int] = {}
        for d in deltas:
            for o in d.outputs:
                per_index[o.index] = per_index.get(o.index, 0) + len(o.token_ids)
        assert sorted(per_index) == [0, 1]
    assert engine.stats().num_kv_blocks_used == 0


def test_closing_the_stream_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    async def main():
        await engine.start()
        gen = engine.generate(
            "Count to a thousand:", SamplingParams(max_tokens=500, ignore_eos=True), "long"
        )
        await gen.__anext__()
        await gen.__anext__()
        assert engine.stats().num_running_reqs == 1
        await gen.aclose()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.stats().num_running_reqs == 0:
                break
        return engine.stats()

    stats = run(main())
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.num_kv_blocks_used == 0


def test_invalid_requests_raise_before_streaming(engine: AsyncEngine) -> None:
    async def main():
        await engine.start()
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, [1] * 9000, SamplingParams(max_tokens=1), "too-long")
        with pytest.raises(ValueError, match="vocabulary"):
            await collect(engine, [1, 10**6], SamplingParams(max_tokens=1), "bad-ids")
        # The engine still serves afterwards.
        ok = await collect(engine, "Hello", SamplingParams(max_tokens=2, ignore_eos=True), "after")
        return ok

    ok = run(main())
    assert ok[-1].finished and engine.health().alive


def test_embeddings_are_normalized(engine: AsyncEngine) -> None:
    async def main():
        await engine.start()
        return await engine.embed([[1, 2, 3], [4, 5, 6, 7]])

    vectors = run(main())
    assert len(vectors) == 2 and len(vectors[0]) == engine.model_config.hidden_size
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-5
