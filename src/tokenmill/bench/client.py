"""One streaming request to an OpenAI-compatible server, timed on the client.

The request goes to /v1/completions or /v1/chat/completions with `stream: true` and
`stream_options.include_usage`, and the server-sent events are read as they arrive:

    send ──► first content chunk ──► next ... ──► last content chunk ──► [DONE]
    |◄─ TTFT ─►|◄─ ITL[0] ─►|               |◄─ ITL[-1] ─►|
    |◄──────────────────────────── E2E ─────────────────────────────────►|

A content chunk is one whose choice carries non-empty text (completions `text`, chat
`delta.content`): chat's leading `{"role": "assistant"}` chunk and empty keep-alives are
not tokens, so they start no clock. ITL holds every gap between consecutive content
chunks; a chunk may carry several tokens, so ITL is per chunk, not per token.

Output tokens come from the final `usage.completion_tokens`; a server that sends no usage
gets its text re-tokenized with the given tokenizer; with neither, the request fails
(chunks are never counted as tokens). TPOT = (E2E - TTFT) / (output tokens - 1).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.bench.workloads import BenchRequest, TextTokenizer

ENDPOINTS = {"completions": "/completions", "chat": "/chat/completions"}


@dataclass
class RequestResult:
    """What the client saw of one request; times in seconds."""

    ok: bool = False
    error: str = ""
    # Clock reading when the request was sent.
    start_s: float = 0.0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    # From the server's usage; None when it sent none.
    prompt_tokens: int | None = None
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for failed or 1-token outputs."""
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class SamplingOptions:
    """The sampling fields every request carries."""

    temperature: float = 0.0
    # vLLM's (and tokenmill's) extension: generate exactly max_tokens. Sent only when set.
    ignore_eos: bool = False
    # Merged into every request body last (--extra-body): response_format, tools, ...
    extra_body: tuple[tuple[str, Any], ...] = ()


def api_root(base_url: str) -> str:
    """'http://h:p', 'http://h:p/' or 'http://h:p/v1' -> 'http://h:p/v1'."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def request_body(
    endpoint: str, model: str, request: BenchRequest, options: SamplingOptions
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = request.chat_messages()
    elif endpoint == "completions":
        body["prompt"] = request.completion_prompt()
    else:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
    if options.ignore_eos:
        body["ignore_eos"] = True
    body.update(dict(options.extra_body))
    return body


class StreamingClient:
    """Sends BenchRequests to one server and times them."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        base_url: str,
        model: str,
        endpoint: str = "completions",
        options: SamplingOptions | None = None,
        api_key: str | None = None,
        tokenizer: TextTokenizer | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
        self.http = http
        self.url = api_root(base_url) + ENDPOINTS[endpoint]
        self.model = model
        self.endpoint = endpoint
        self.options = options or SamplingOptions()
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.tokenizer = tokenizer
        self.clock = clock

    async def wait_until_serving(self, timeout_s: float) -> None:
        """Sends a 1-token probe until it streams text. A server still loading refuses the
        connection or answers 5xx (tokenmill: 503 "engine is loading"), which is retried;
        a 4xx (wrong model, bad key) is left for the run to report."""
        probe = BenchRequest("Hello", [{"role": "user", "content": "Hello"}], output_len=1, prompt_len=None)
        deadline = time.monotonic() + timeout_s
        while True:
            result = await self.send(probe)
            if result.ok or result.text or result.error.startswith("HTTP 4"):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.url} not serving after {timeout_s:g} s: {result.error}")
            await asyncio.sleep(0.5)

    async def send(self, request: BenchRequest) -> RequestResult:
        body = request_body(self.endpoint, self.model, request, self.options)
        result = RequestResult(start_s=self.clock())
        try:
            usage_tokens = await self._stream(body, result)
        except (httpx.HTTPError, ValueError) as e:
            result.error = f"{type(e).__name__}: {e}"[:300]
            return result
        if result.error:
            return result
        if not result.text:
            result.error = "no tokens streamed"
            return result
        if usage_tokens is not None:
            result.output_tokens = usage_tokens
        elif self.tokenizer is not None:
            result.output_tokens = len(self.tokenizer.encode(result.text))
        else:
            result.error = "the server sent no usage and no tokenizer was given to count tokens"
            return result
        result.ok = True
        return result

    async def _stream(self, body: dict[str, Any], result: RequestResult) -> int | None:
        """Reads the event stream into `result`; returns usage.completion_tokens if sent."""
        usage_tokens = None
        last_s: float | None = None
        parts: list[str] = []
        async with self.http.stream("POST", self.url, json=body, headers=self.headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = self.clock()
                chunk = json.loads(data)
                if chunk.get("error") and not chunk.get("choices"):
                    result.error = f"stream error: {str(chunk['error'])[:300]}"
                    return None
                text = "".join(_choice_text(choice) for choice in chunk.get("choices") or [])
                if text:
                    if last_s is None:
                        result.ttft_s = now - result.start_s
                    else:
                        result.itl_s.append(now - last_s)
                    last_s = now
                    parts.append(text)
                usage = chunk.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens")
                    result.prompt_tokens = usage.get("prompt_tokens")
        result.e2e_s = self.clock() - result.start_s
        result.text = "".join(parts)
        return usage_tokens


def _choice_text(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        delta = choice["delta"] or {}
        return str(delta.get("content") or "") + str(delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")

