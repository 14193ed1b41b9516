"""The load generator against tokenmill's real HTTP server (over the deterministic FakeEngine).

The FakeEngine emits one byte token per step and reports usage, so every count is exact:
output tokens, content chunks, prompt tokens; timings are only bounded below by its step delay.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from fake_engine import FakeEngine
from server_harness import ThreadedServer

from tokenmill.bench.client import SamplingOptions
from tokenmill.bench.runner import LoadConfig, Target, run_benchmark
from tokenmill.bench.workloads import LengthRange, multi_turn_requests, random_requests

MODEL = "fake-model"  # the served name the bench conftest's server answers to


class PrintableBytes:
    """Byte ids 97-122 (a-z) only, so every streamed token is one visible character."""

    vocab_size = 123
    special_token_ids = frozenset(range(97))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_random_workload_counts_are_exact(
    fake_server: ThreadedServer, fake_engine: FakeEngine, endpoint: str
) -> None:
    requests = random_requests(10, LengthRange(12, 12), LengthRange(8, 8), seed=0, tokenizer=PrintableBytes())
    target = Target(fake_server.base_url, MODEL, endpoint, options=SamplingOptions(ignore_eos=True))
    report = asyncio.run(
        run_benchmark(target, requests, LoadConfig(concurrency=4, num_warmups=2), show_progress=False)
    )
    assert report["failed"] == 0, report["errors"]
    assert report["completed"] == 8
    assert report["total_output_tokens"] == 64
    assert all(r["output_tokens"] == 8 and r["num_chunks"] == 8 for r in report["requests"])
    if endpoint == "completions":
        assert report["total_input_tokens"] == 8 * 12  # token-id prompts, exactly
        # 4 in flight: the server may see them in any order.
        assert sorted(c.prompt for c in fake_engine.calls) == sorted(r.prompt for r in requests)
    else:  # chat: the server's template wraps the text; usage reports what it tokenized
        assert all(r["prompt_tokens"] > 12 for r in report["requests"])
    assert all(c.params.ignore_eos and c.params.max_tokens == 8 for c in fake_engine.calls)
    # each step sleeps 2 ms: a first token and 7 more can't come faster
    assert report["ttft_ms"]["min"] >= 2.0
    assert report["e2e_ms"]["min"] >= 16.0
    assert report["output_throughput"] == pytest.approx(64 / report["duration_s"])


def test_multi_turn_workload_over_completions(fake_server: ThreadedServer, fake_engine: FakeEngine) -> None:
    requests = multi_turn_requests(6, 4, seed=0, num_system_prompts=2, system_prompt_len=30, num_turns=2)
    target = Target(fake_server.base_url, MODEL, "completions", options=SamplingOptions(ignore_eos=True))
    report = asyncio.run(run_benchmark(target, requests, LoadConfig(concurrency=2), show_progress=False))
    assert report["completed"] == 6 and report["failed"] == 0
    prompts = [bytes(c.prompt).decode() for c in fake_engine.calls]
    assert sorted(prompts) == sorted(r.completion_prompt() for r in requests)
    assert all(p.startswith("system: ") and p.endswith("\n\nassistant:") for p in prompts)


def test_unknown_model_fails_every_request(fake_server: ThreadedServer) -> None:
    requests = random_requests(3, LengthRange(4, 4), LengthRange(2, 2), seed=0, tokenizer=PrintableBytes())
    report = asyncio.run(
        run_benchmark(Target(fake_server.base_url, "other"), requests, LoadConfig(), show_progress=False)
    )
    assert report["completed"] == 0 and report["failed"] == 3
    (error,) = report["errors"]
    assert error.startswith("HTTP 404")
