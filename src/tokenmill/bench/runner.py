"""The load loop: how requests are released to the server, and the run's report.

Two ways to offer load:

  * closed loop (`concurrency=N`, no rate): N workers each keep one request in flight;
    a worker sends its next request as soon as the previous one ends. Throughput is what
    the server sustains at that concurrency.
  * open loop (`request_rate=R`): request i is released at a fixed offset from the start,
    whatever the server's state; the gaps between releases are gamma-distributed with
    shape `burstiness` and mean 1/R, so burstiness 1 is a Poisson process, < 1 burstier,
    > 1 more regular (vLLM's convention). An infinite rate releases everything at once.
    `concurrency`, when set, caps requests in flight (a released request waits for a slot).

Warm-up requests (the workload's first `num_warmups`) go out first, `concurrency` at a
time, and are not measured. The measured duration runs from the first measured release
to the end of the last measured request.
"""

from __future__ import annotations

import asyncio
import math
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from tokenmill.bench.client import (
    RequestResult,
    SamplingOptions,
    StreamingClient,
)
from tokenmill.bench.metrics import SLO, summarize
from tokenmill.bench.progress import Progress, make_progress
from tokenmill.bench.workloads import BenchRequest, TextTokenizer


@dataclass(frozen=True)
class Target:
    """The server under test."""

    base_url: str
    model: str
    endpoint: str = "completions"
    api_key: str | None = None
    options: SamplingOptions = field(default_factory=SamplingOptions)
    # Seconds one request may take end to end.
    timeout_s: float = 1800.0


@dataclass(frozen=True)
class LoadConfig:
    """How load is offered."""

    # Closed loop: requests in flight. Open loop: the cap on in-flight requests (None: none).
    concurrency: int | None = 1
    # Open loop when set: mean requests per second (math.inf: all at once).
    request_rate: float | None = None
    # Shape of the gamma inter-arrival distribution (1: Poisson).
    burstiness: float = 1.0
    num_warmups: int = 0
    # Seeds the arrival times.
    seed: int = 0

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate is None and self.concurrency is None:
            raise ValueError("a closed loop needs a concurrency (or set a request rate)")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request rate must be positive, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be positive, got {self.burstiness}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")

    @property
    def is_open_loop(self) -> bool:
        return self.request_rate is not None


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Release times in seconds from the start: 0, then cumulative gamma(shape, 1/(rate*shape)) gaps."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for i in range(num):
        if i > 0:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets


async def run_load(
    client: StreamingClient,
    requests: Sequence[BenchRequest],
    load: LoadConfig,
    progress: Progress,
) -> tuple[list[RequestResult], float]:
    """Sends the measured requests as `load` says: (results in request order, duration_s)."""
    results: list[RequestResult | None] = [None] * len(requests)
    slots = asyncio.Semaphore(load.concurrency) if load.concurrency is not None else None

    async def one(i: int) -> None:
        if slots is None:
            results[i] = await client.send(requests[i])
        else:
            async with slots:
                results[i] = await client.send(requests[i])
        progress.update(1)

    start = client.clock()
    if load.is_open_loop:
        assert load.request_rate is not None
        offsets = arrival_offsets(len(requests), load.request_rate, load.burstiness, load.seed)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = []
        for i, offset in enumerate(offsets):
            delay = t0 + offset - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    else:
        queue = iter(range(len(requests)))

        async def worker() -> None:
            for i in queue:  # one shared iterator: each index goes to exactly one worker
                await one(i)

        assert load.concurrency is not None
        await asyncio.gather(*(worker() for _ in range(load.concurrency)))
    duration = client.clock() - start
    done = [r for r in results if r is not None]
    assert len(done) == len(requests)
    return done, duration


async def run_benchmark(
    target: Target,
    requests: Sequence[BenchRequest],
    load: LoadConfig,
    slo: SLO | None = None,
    tokenizer: TextTokenizer | None = None,
    show_progress: bool = True,
    transport: httpx.AsyncBaseTransport | None = None,
    ready_timeout_s: float = 0.0,
) -> dict[str, Any]:
    """Wait for the server (when `ready_timeout_s` > 0), warm up, run the measured requests,
    and return the JSON report."""
    if len(requests) <= load.num_warmups:
        raise ValueError(f"{len(requests)} requests leave none to measure after {load.num_warmups} warm-ups")
    warmups, measured = requests[: load.num_warmups], requests[load.num_warmups :]
    in_flight = load.concurrency or len(requests)
    limits = httpx.Limits(max_connections=in_flight + 8, max_keepalive_connections=in_flight + 8)
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, transport=transport) as http:
        client = StreamingClient(
            http, target.base_url, target.model, target.endpoint, target.options, target.api_key, tokenizer
        )
        if ready_timeout_s > 0:
            await client.wait_until_serving(ready_timeout_s)
        warm_results: list[RequestResult] = []
        if warmups:
            warm_load = LoadConfig(concurrency=min(in_flight, len(warmups)))
            warm_results, _ = await run_load(client, warmups, warm_load, make_progress(0, "warm-up", False))
        progress = make_progress(len(measured), "bench", show_progress)
        try:
            results, duration = await run_load(client, measured, load, progress)
        finally:
            progress.close()
    first_start = min(r.start_s for r in results)
    for request, result in zip(measured, results, strict=True):
        if result.ok and result.prompt_tokens is None:
            result.prompt_tokens = request.prompt_len
    return {
        "started_at": started_at,
        "config": {
            "base_url": target.base_url,
            "model": target.model,
            "endpoint": target.endpoint,
            **asdict(target.options),
            **asdict(load),
            # JSON has no infinity
            "request_rate": "inf" if load.request_rate == math.inf else load.request_rate,
            "num_prompts": len(measured),
        },
        "client": {"python": platform.python_version(), "httpx": httpx.__version__},
        "warmup_failed": sum(1 for r in warm_results if not r.ok),
        **summarize(results, duration, slo),
        "requests": [
            {
                "ok": r.ok,
                "error": r.error,
                "start_ms": (r.start_s - first_start) * 1000,
                "ttft_ms": r.ttft_s * 1000,
                "tpot_ms": None if r.tpot_s is None else r.tpot_s * 1000,
                "e2e_ms": r.e2e_s * 1000,
                "num_chunks": len(r.itl_s) + 1 if r.ok else 0,
                "prompt_tokens": r.prompt_tokens,
                "output_tokens": r.output_tokens,
                "max_tokens": q.output_len,
            }
            for q, r in zip(measured, results, strict=True)
        ],
    }
