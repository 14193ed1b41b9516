"""StreamingClient against a scripted server: exact TTFT / ITL / E2E / TPOT and token counts."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx
import pytest
from scripted_server import (
    Script,
    ScriptedTransport,
    chat_chunk,
    completion_chunk,
    usage_chunk,
)

from tokenmill.bench.client import (
    RequestResult,
    SamplingOptions,
    StreamingClient,
    api_root,
    request_body,
)
from tokenmill.bench.workloads import BenchRequest


class CharTokenizer:
    """One token per character."""

    vocab_size = 256
    special_token_ids = frozenset({255})

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


REQUEST = BenchRequest([5, 6, 7], [{"role": "user", "content": "hi"}], output_len=3, prompt_len=3)


def send(
    script: Script, endpoint: str = "completions", tokenizer: CharTokenizer | None = None, **kwargs: object
) -> tuple[RequestResult, ScriptedTransport]:
    transport = ScriptedTransport(lambda body: script, **kwargs)  # type: ignore[arg-type]

    async def go() -> RequestResult:
        async with httpx.AsyncClient(transport=transport) as http:
            client = StreamingClient(
                http, "http://server:1", "m", endpoint, SamplingOptions(ignore_eos=True), "key",
                tokenizer, clock=transport.clock,
            )
            return await client.send(REQUEST)

    return asyncio.run(go()), transport


def test_completions_timings_are_exact_and_tokens_come_from_usage() -> None:
    # send at 0; content at 0.25, 0.375, 0.4375; usage; [DONE] at 0.9375
    script: Script = [
        (0.25, completion_chunk("a")),
        (0.125, completion_chunk("bc")),  # one chunk, two tokens
        (0.0625, completion_chunk("d")),
        (0.0, usage_chunk(3, 4)),
        (0.5, "[DONE]"),
    ]
    result, transport = send(script)
    assert result.ok and result.error == ""
    assert result.ttft_s == 0.25
    assert result.itl_s == [0.125, 0.0625]
    assert result.e2e_s == 0.9375
    assert result.output_tokens == 4  # usage, not the 3 chunks
    assert result.prompt_tokens == 3
    assert result.tpot_s == (0.9375 - 0.25) / 3
    assert result.text == "abcd"
    assert transport.urls == ["http://server:1/v1/completions"]
    assert transport.headers[0]["authorization"] == "Bearer key"
    assert transport.bodies == [
        {
            "model": "m",
            "prompt": [5, 6, 7],
            "max_tokens": 3,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
    ]


def test_chat_role_chunk_is_not_the_first_token() -> None:
    script: Script = [
        (0.5, chat_chunk({"role": "assistant", "content": ""})),
        (0.25, chat_chunk({"content": "x"})),
        (0.125, chat_chunk({"content": "y"})),
        (0.0, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),
        (0.0, usage_chunk(9, 2)),
        (0.0, "[DONE]"),
    ]
    result, transport = send(script, endpoint="chat")
    assert result.ok
    assert result.ttft_s == 0.75
    assert result.itl_s == [0.125]
    assert result.e2e_s == 0.875
    assert result.output_tokens == 2
    assert result.tpot_s == 0.125
    assert transport.urls == ["http://server:1/v1/chat/completions"]
    assert transport.bodies[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert "prompt" not in transport.bodies[0]


def test_without_usage_the_tokenizer_counts_output_tokens() -> None:
    script: Script = [(0.25, completion_chunk("hello ")), (0.25, completion_chunk("world")), (0.0, "[DONE]")]
    result, _ = send(script, tokenizer=CharTokenizer())
    assert result.ok
    assert result.output_tokens == 11  # characters of "hello world", not 2 chunks
    assert result.prompt_tokens is None


def test_without_usage_or_tokenizer_the_request_fails() -> None:
    result, _ = send([(0.25, completion_chunk("hello")), (0.0, "[DONE]")])
    assert not result.ok
    assert result.error == "the server sent no usage and no tokenizer was given to count tokens"
    assert result.tpot_s is None


def test_http_error_and_stream_error_and_empty_stream_fail() -> None:
    result, _ = send([], status_code=503)
    assert not result.ok
    assert result.error.startswith("HTTP 503: ")
    assert "scripted failure" in result.error

    result, _ = send([(0.1, {"error": {"message": "engine died"}}), (0.0, "[DONE]")])
    assert not result.ok
    assert result.error == "stream error: {'message': 'engine died'}"

    result, _ = send([(0.1, usage_chunk(3, 0)), (0.0, "[DONE]")])
    assert result.error == "no tokens streamed"


def test_single_token_output_has_no_tpot() -> None:
    result, _ = send([(0.25, completion_chunk("a")), (0.0, usage_chunk(3, 1)), (0.0, "[DONE]")])
    assert result.ok and result.output_tokens == 1
    assert result.tpot_s is None


def test_request_body_and_api_root() -> None:
    assert api_root("http://h:1") == "http://h:1/v1"
    assert api_root("http://h:1/") == "http://h:1/v1"
    assert api_root("http://h:1/v1/") == "http://h:1/v1"
    ids_only = BenchRequest([1, 2], None, 4, 2)
    with pytest.raises(ValueError, match="chat endpoint needs text"):
        request_body("chat", "m", ids_only, SamplingOptions())
    body = request_body("completions", "m", ids_only, SamplingOptions(temperature=0.7))
    assert body["prompt"] == [1, 2] and body["temperature"] == 0.7 and "ignore_eos" not in body
    chat_only = BenchRequest(None, [{"role": "user", "content": "q"}], 4, None)
    assert request_body("completions", "m", chat_only, SamplingOptions())["prompt"] == "user: q\n\nassistant:"
    with pytest.raises(ValueError, match="endpoint"):
        request_body("embeddings", "m", ids_only, SamplingOptions())
    fmt = {"type": "json_object"}
    extra = request_body("completions", "m", ids_only, SamplingOptions(extra_body=(("response_format", fmt), ("temperature", 1.0))))
    assert extra["response_format"] == fmt and extra["temperature"] == 1.0  # merged last


def test_wait_until_serving_retries_5xx_and_times_out_with_the_reason() -> None:
    async def go(transport: httpx.MockTransport, timeout_s: float) -> None:
        async with httpx.AsyncClient(transport=transport) as http:
            await StreamingClient(http, "http://server:1", "m").wait_until_serving(timeout_s)

    calls: list[int] = []

    def loading_then_ready(request: httpx.Request) -> httpx.Response:
        calls.append(1)
        if len(calls) < 3:
            return httpx.Response(503, text="engine is loading")
        return httpx.Response(200, text='data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n')

    asyncio.run(go(httpx.MockTransport(loading_then_ready), timeout_s=5.0))
    assert len(calls) == 3
    with pytest.raises(TimeoutError, match="HTTP 503: engine is loading"):
        asyncio.run(go(httpx.MockTransport(lambda r: httpx.Response(503, text="engine is loading")), 0.0))
    # a 4xx is not "loading": returned at once, for the run to report
    asyncio.run(go(httpx.MockTransport(lambda r: httpx.Response(404, text="no such model")), 0.0))
