"""The gateway: prefix-aware vs round-robin on a real fleet, added latency, raw throughput.

Three scenarios, each on processes this script starts on free localhost ports and stops:

1. `prefix`: three `tokenmill serve` replicas (OMP_NUM_THREADS=1 each) behind a gateway with
   round-robin, then behind one with prefix-aware routing, on the same shared-system-prompt
   workload (NUM_APPS system prompts, each followed by several short user turns, sent by
   `--prefix-concurrency` clients; each policy gets fresh prompts so neither warms the other,
   and every replica serves two unrelated prompts first, so the first policy does not pay
   the replicas' first-request costs). Reports the fleet's prefix-cache hit rate (hits /
   queries summed over the replicas' /metrics) and median TTFT (streamed, first content
   chunk) per policy.
2. `overhead`: a stub backend that answers after `--stub-delay-s`, hit directly and through
   the gateway at concurrency 64, in `--rounds` alternating rounds; reports each round's
   median and p99 of both, and the median over rounds of the differences.
3. `throughput`: the gateway in front of a stub that answers at once, concurrency 64:
   requests/s (and the direct stub's requests/s for scale).

    python benchmarks/gateway.py [--scenarios prefix overhead throughput] [--out FILE]

writes benchmarks/results/gateway.json. The load generator is in this process (aiohttp on
uvloop), so on a small machine it shares the cores with what it measures; compare numbers
from one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import uvloop

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gateway"))

from gateway_harness import GatewayProc, Proc, Stub, free_port, metric_value  # noqa: E402

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"
NUM_APPS = 8
TURNS_PER_APP = 4


def gateway_config(backends: list[dict[str, Any]], policy: str) -> dict[str, Any]:
    return {
        "regions": {"local": {"residency": "local"}},
        "models": [{"name": MODEL}],
        "pools": [{"name": "all", "model": MODEL, "region": "local", "policy": policy, "backends": backends}],
        "auth": {"anonymous_tenant": "bench"},
        "tenants": [{"name": "bench"}],
        "cache": {"enabled": False},
        "priorities": {"classes": {"interactive": {"max_queue": 4096, "queue_timeout_s": 600}}},
        "health": {"interval_s": 1.0, "timeout_s": 5.0, "failure_threshold": 3, "open_s": 5.0},
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# -- scenario 1: prefix-aware vs round-robin on real replicas ------------------------------

def start_replicas(tmp: Path, num: int) -> list[tuple[str, Proc]]:
    replicas: list[tuple[str, Proc]] = []
    try:
        for i in range(num):
            port = free_port()
            cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", MODEL, "--port", str(port),
                   "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024"]
            url = f"http://127.0.0.1:{port}"
            replicas.append((url, Proc(cmd, tmp / f"replica{i}.log", url + "/health", env={"OMP_NUM_THREADS": "1"})))
        for url, _ in replicas:
            while httpx.get(url + "/ready", timeout=10).status_code != 200:
                time.sleep(0.1)
    except BaseException:
        for _, proc in replicas:
            proc.kill()
        raise
    return replicas


def warm_up(urls: list[str]) -> None:
    """Two requests straight to each replica, with prompts that share nothing with the workload."""
    for url in urls:
        for i in range(2):
            content = f"warm-up {uuid.uuid4().hex} {i}. " + "Nothing here is reused later. " * 24
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            httpx.post(url + CHAT, json=body, timeout=120).raise_for_status()


def fleet_counters(urls: list[str]) -> tuple[float, float]:
    queries = hits = 0.0
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        queries += metric_value(text, "tokenmill:prefix_cache_queries_total")
        hits += metric_value(text, "tokenmill:prefix_cache_hits_total")
    return queries, hits


def has_content(frame: bytes) -> bool:
    """A chunk with generated text (not the opening role chunk, whose content is empty)."""
    choices = json.loads(frame).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def conversations(base: str, concurrency: int) -> list[float]:
    """TTFTs of NUM_APPS apps x TURNS_PER_APP turns; each app's turns in order, apps in parallel."""
    nonce = uuid.uuid4().hex[:8]
    ttfts: list[float] = []
    semaphore = asyncio.Semaphore(concurrency)

    async def app(session: aiohttp.ClientSession, i: int) -> None:
        system = f"{nonce} app {i}. " + f"You are the assistant of application {i}; be brief and exact. " * 12
        for turn in range(TURNS_PER_APP):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Turn {turn}: hello?"}]
            body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
            async with semaphore:
                start = time.perf_counter()
                async with session.post(base + CHAT, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    first: float | None = None
                    async for line in resp.content:
                        if first is None and line.startswith(b"data: {") and has_content(line[6:]):
                            first = time.perf_counter() - start
                    ttfts.append(first if first is not None else time.perf_counter() - start)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(app(session, i) for i in range(NUM_APPS)))
    return ttfts


def prefix_scenario(tmp: Path, concurrency: int) -> dict[str, Any]:
    replicas = start_replicas(tmp, 3)
    urls = [url for url, _ in replicas]
    backends = [{"url": url, "name": f"r{i}", "max_inflight": 8} for i, url in enumerate(urls)]
    out: dict[str, Any] = {"num_replicas": 3, "apps": NUM_APPS, "turns_per_app": TURNS_PER_APP,
                           "concurrency": concurrency}
    try:
        warm_up(urls)
        for policy in ("round_robin", "prefix_aware"):
            gw = GatewayProc(tmp, gateway_config(backends, policy), name=policy)
            try:
                q0, h0 = fleet_counters(urls)
                ttfts = uvloop.run(conversations(gw.url, concurrency))
                q1, h1 = fleet_counters(urls)
            finally:
                gw.stop()
            out[policy] = {"prefix_cache_hit_rate": round((h1 - h0) / (q1 - q0), 4),
                           "median_ttft_ms": round(statistics.median(ttfts) * 1e3, 1),
                           "p90_ttft_ms": round(percentile(ttfts, 0.9) * 1e3, 1)}
    finally:
        for _, proc in replicas:
            proc.stop()
    rr, pa = out["round_robin"], out["prefix_aware"]
    out["hit_rate_ratio"] = round(pa["prefix_cache_hit_rate"] / max(rr["prefix_cache_hit_rate"], 1e-9), 2)
    out["ttft_reduction"] = round(1 - pa["median_ttft_ms"] / rr["median_ttft_ms"], 3)
    return out


# -- scenarios 2 and 3: closed-loop load on the gateway and on the stub directly ----------

async def closed_loop(url: str, concurrency: int, duration_s: float) -> tuple[float, list[float], int]:
    """(requests/s, latencies, errors) of `concurrency` clients posting for `duration_s`."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}).encode()
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def client(until: float) -> None:
            nonlocal errors
            while time.perf_counter() < until:
                start = time.perf_counter()
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    errors += resp.status != 200
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(client(time.perf_counter() + 0.5) for _ in range(concurrency)))  # warm-up
        latencies.clear()
        start = time.perf_counter()
        await asyncio.gather(*(client(start + duration_s) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return len(latencies) / elapsed, latencies, errors


def stub_and_gateway(tmp: Path, name: str, delay_s: float) -> tuple[Stub, GatewayProc]:
    stub = Stub(tmp, name, delay_s=delay_s)
    backends = [{"url": stub.url, "name": name, "kind": "openai", "max_inflight": 1024}]
    return stub, GatewayProc(tmp, gateway_config(backends, "least_load"), name=f"gateway-{name}")


def overhead_scenario(tmp: Path, delay_s: float, duration_s: float, rounds: int) -> dict[str, Any]:
    """Alternating rounds, direct then through the gateway; the added latency is the median
    over rounds of each round's difference, so one round hit by a neighbour's burst of CPU
    does not decide the result."""
    stub, gw = stub_and_gateway(tmp, "delayed", delay_s)
    per_round = []
    try:
        for _ in range(rounds):
            direct = uvloop.run(closed_loop(stub.url + CHAT, 64, duration_s))[1]
            through = uvloop.run(closed_loop(gw.url + CHAT, 64, duration_s))[1]
            per_round.append({"direct": summary(direct), "gateway": summary(through)})
    finally:
        gw.stop()
        stub.kill()
    added_median = [r["gateway"]["median_ms"] - r["direct"]["median_ms"] for r in per_round]
    added_p99 = [r["gateway"]["p99_ms"] - r["direct"]["p99_ms"] for r in per_round]
    return {"concurrency": 64, "stub_delay_s": delay_s, "rounds": per_round,
            "added_median_ms": round(statistics.median(added_median), 3),
            "added_p99_ms": round(statistics.median(added_p99), 3)}


def summary(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values) * 1e3, 3), "p99_ms": round(percentile(values, 0.99) * 1e3, 3),
            "num_requests": len(values)}


def throughput_scenario(tmp: Path, duration_s: float) -> dict[str, Any]:
    stub, gw = stub_and_gateway(tmp, "fast", 0.0)
    try:
        direct_rps, _, direct_errors = uvloop.run(closed_loop(stub.url + CHAT, 64, duration_s))
        rps, latencies, errors = uvloop.run(closed_loop(gw.url + CHAT, 64, duration_s))
    finally:
        gw.stop()
        stub.kill()
    return {"concurrency": 64, "gateway_requests_per_s": round(rps, 1), "gateway_errors": errors,
            "gateway_median_ms": round(statistics.median(latencies) * 1e3, 2),
            "direct_stub_requests_per_s": round(direct_rps, 1), "direct_errors": direct_errors}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenarios", nargs="+", default=["prefix", "overhead", "throughput"],
                        choices=["prefix", "overhead", "throughput"])
    parser.add_argument("--prefix-concurrency", type=int, default=4)
    parser.add_argument("--stub-delay-s", type=float, default=0.1)
    parser.add_argument("--duration-s", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gateway.json"))
    args = parser.parse_args()
    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_at_start": list(os.getloadavg())},
    }
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if "prefix" in args.scenarios:
            result["prefix"] = prefix_scenario(tmp, args.prefix_concurrency)
            print(json.dumps({"prefix": result["prefix"]}), flush=True)
        if "overhead" in args.scenarios:
            result["overhead"] = overhead_scenario(tmp, args.stub_delay_s, args.duration_s, args.rounds)
            print(json.dumps({"overhead": result["overhead"]}), flush=True)
        if "throughput" in args.scenarios:
            result["throughput"] = throughput_scenario(tmp, args.duration_s)
            print(json.dumps({"throughput": result["throughput"]}), flush=True)
    result["machine"]["load_average_at_end"] = list(os.getloadavg())
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
