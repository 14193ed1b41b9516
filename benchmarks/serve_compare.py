"""Serving benchmark: closed-loop streaming load on any OpenAI-compatible /v1/completions endpoint.

Used to compare tokenmill's server with a peer (vLLM) on identical inputs:
  - every prompt is exactly --input-len random token ids from [100, 49000) (fixed --seed),
    sent as a token-id list in `prompt`, so both servers see the same tokens. If a server
    rejects token-id prompts, the ids are turned into text through the server's
    /detokenize route when it has one (else random words) and the run notes `prompt_mode`.
  - `max_tokens` = --output-len, `ignore_eos: true`, `temperature: 0`, `stream: true`,
    `stream_options: {"include_usage": true}`.
  - --concurrency C workers each keep one request in flight until --num-prompts are done
    (closed loop), after --num-warmups warm-up requests that are not counted.

Per request: TTFT (send -> first chunk carrying a choice), ITL (every gap between
consecutive such chunks), TPOT = (E2E - TTFT) / (output tokens - 1), E2E. Output tokens come
from `usage.completion_tokens` of the final chunk, else the number of choice chunks.
Reports mean / median / p90 / p99 (ms) of each, request and token throughput and failures,
and writes JSON to --out.

    python benchmarks/serve_compare.py --base-url http://127.0.0.1:8100 \
        --model smollm2-135m-instruct --input-len 256 --output-len 128 \
        --concurrency 32 --num-prompts 96 --out benchmarks/results/serve_tokenmill_c32.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

VOCAB_LOW, VOCAB_HIGH = 100, 49000


@dataclass
class Result:
    index: int
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    usage_tokens: int | None = None
    chunks: int = 0
    prompt_tokens: int | None = None
    itl_s: list[float] = field(default_factory=list)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def make_prompts(n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(input_len)] for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    data = sorted(values)
    if not data:
        return float("nan")
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def summarize(values_s: list[float]) -> dict[str, float | int]:
    ms = [v * 1000.0 for v in values_s]
    if not ms:
        return {"count": 0}
    return {
        "count": len(ms),
        "mean_ms": sum(ms) / len(ms),
        "median_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.url = args.base_url.rstrip("/")
        if not self.url.endswith("/v1"):
            self.url += "/v1"
        self.prompt_mode = "token_ids"
        self.text_prompts: dict[int, str] = {}

    def body(self, prompt: list[int] | str) -> dict[str, Any]:
        return {
            "model": self.args.model,
            "prompt": prompt,
            "max_tokens": self.args.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def one(self, client: httpx.AsyncClient, index: int, prompt: list[int] | str) -> Result:
        result = Result(index=index)
        last = None
        start = time.perf_counter()
        try:
            async with client.stream("POST", self.url + "/completions", json=self.body(prompt)) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text[:300]}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk and not chunk.get("choices"):
                        result.error = f"stream error: {str(chunk['error'])[:300]}"
                        return result
                    if chunk.get("choices"):
                        if last is None:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
                        result.chunks += 1
                    usage = chunk.get("usage")
                    if usage:
                        result.usage_tokens = usage.get("completion_tokens")
                        result.prompt_tokens = usage.get("prompt_tokens")
            result.e2e_s = time.perf_counter() - start
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"[:300]
            return result
        if last is None:
            result.error = "no tokens streamed"
            return result
        result.output_tokens = result.usage_tokens if result.usage_tokens else result.chunks
        result.ok = True
        return result

    async def choose_prompt_mode(self, client: httpx.AsyncClient, prompts: list[list[int]]) -> None:
        """Probe token-id prompts with a 1-token request; fall back to text if rejected (4xx).

        While the server is still starting (connection refused, 5xx such as 503 "loading"),
        the probe is retried for up to --ready-timeout seconds.
        """
        body = self.body(prompts[0]) | {"max_tokens": 1, "stream": False}
        body.pop("stream_options")
        deadline = time.monotonic() + self.args.ready_timeout
        while True:
            try:
                response = await client.post(self.url + "/completions", json=body)
                if response.status_code == 200 or 400 <= response.status_code < 500:
                    break
                reason = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise SystemExit(f"server not ready after {self.args.ready_timeout:.0f} s: {reason}")
            await asyncio.sleep(1.0)
        if response.status_code == 200:
            return
        print(f"token-id prompts rejected ({response.status_code}: {response.text[:200]}); using text", file=sys.stderr)
        self.prompt_mode = "text"
        root = self.url[: -len("/v1")]
        for i, ids in enumerate(prompts):
            text = None
            try:
                r = await client.post(root + "/detokenize", json={"model": self.args.model, "tokens": ids})
                if r.status_code == 200:
                    text = r.json().get("prompt")
            except httpx.HTTPError:
                pass
            if text is None:
                self.prompt_mode = "text_random_words"
                rng = random.Random(self.args.seed + i)
                text = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat", "and", "dog"]) for _ in ids)
            self.text_prompts[i] = text

    def prompt(self, prompts: list[list[int]], i: int) -> list[int] | str:
        return self.text_prompts[i] if self.prompt_mode != "token_ids" else prompts[i]

    async def run(self) -> dict[str, Any]:
        args = self.args
        total = args.num_warmups + args.num_prompts
        prompts = make_prompts(total, args.input_len, args.seed)
        limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
        timeout = httpx.Timeout(args.request_timeout, connect=30.0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            await self.choose_prompt_mode(client, prompts)

            # Warm-up: not counted; as concurrent as the measured run, at most num_warmups at once.
            warm = await asyncio.gather(
                *(self.one(client, i, self.prompt(prompts, i)) for i in range(args.num_warmups))
            )
            warm_failures = [w.error for w in warm if not w.ok]

            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(args.num_warmups, total):
                queue.put_nowait(i)
            results: list[Result] = []

            async def worker() -> None:
                while True:
                    try:
                        i = queue.get_nowait()
                    except asyncio.QueueEmpty:
                        return
                    results.append(await self.one(client, i, self.prompt(prompts, i)))

            start = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            duration = time.perf_counter() - start

        ok = [r for r in results if r.ok]
        failed = [r for r in results if not r.ok]
        out_tokens = sum(r.output_tokens for r in ok)
        in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else args.input_len for r in ok)
        tpots = [t for r in ok if (t := r.tpot_s) is not None]
        itls = [g for r in ok for g in r.itl_s]
        return {
            "config": {
                "base_url": args.base_url,
                "model": args.model,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "concurrency": args.concurrency,
                "num_prompts": args.num_prompts,
                "num_warmups": args.num_warmups,
                "seed": args.seed,
                "prompt_mode": self.prompt_mode,
                "ignore_eos": True,
                "temperature": 0,
            },
            "client": {"python": platform.python_version(), "httpx": httpx.__version__},
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "duration_s": duration,
            "completed": len(ok),
            "failed": len(failed),
            "warmup_failed": len(warm_failures),
            "errors": sorted({r.error for r in failed} | set(warm_failures))[:10],
            "total_input_tokens": in_tokens,
            "total_output_tokens": out_tokens,
            "output_tokens_mismatch": sum(1 for r in ok if r.output_tokens != args.output_len),
            "request_throughput_rps": len(ok) / duration,
            "output_throughput_tok_s": out_tokens / duration,
            "total_token_throughput_tok_s": (in_tokens + out_tokens) / duration,
            "ttft": summarize([r.ttft_s for r in ok]),
            "tpot": summarize(tpots),
            "itl": summarize(itls),
            "e2e": summarize([r.e2e_s for r in ok]),
            "requests": [
                {
                    "index": r.index,
                    "ok": r.ok,
                    "error": r.error,
                    "ttft_ms": r.ttft_s * 1000,
                    "e2e_ms": r.e2e_s * 1000,
                    "tpot_ms": (r.tpot_s or 0.0) * 1000,
                    "output_tokens": r.output_tokens,
                    "usage_completion_tokens": r.usage_tokens,
                    "chunks": r.chunks,
                    "prompt_tokens": r.prompt_tokens,
                }
                for r in sorted(results, key=lambda r: r.index)
            ],
        }


def print_summary(report: dict[str, Any]) -> None:
    c = report["config"]
    print(
        f"{c['base_url']} model={c['model']} in={c['input_len']} out={c['output_len']} "
        f"C={c['concurrency']} N={c['num_prompts']} prompts={c['prompt_mode']}"
    )
    print(
        f"  completed {report['completed']}, failed {report['failed']} in {report['duration_s']:.2f} s; "
        f"{report['request_throughput_rps']:.3f} req/s, {report['output_throughput_tok_s']:.1f} output tok/s, "
        f"{report['total_token_throughput_tok_s']:.1f} total tok/s"
    )
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = report[name]
        if s.get("count"):
            print(
                f"  {name:5s} mean {s['mean_ms']:9.2f}  median {s['median_ms']:9.2f}  "
                f"p90 {s['p90_ms']:9.2f}  p99 {s['p99_ms']:9.2f} ms"
            )
    if report["errors"]:
        print("  errors:", *report["errors"], sep="\n    ")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (with or without /v1)")
    parser.add_argument("--model", required=True, help="model name the server expects")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-warmups", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the server to serve")
    parser.add_argument("--out", default=None, help="write the JSON report here")
    args = parser.parse_args(argv)
    if min(args.input_len, args.output_len, args.concurrency, args.num_prompts) < 1 or args.num_warmups < 0:
        parser.error("lengths, concurrency and num-prompts must be >= 1, num-warmups >= 0")

    report = asyncio.run(Bench(args).run())
    print_summary(report)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"  wrote {path}")
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
