"""Three real `tokenmill serve` replicas (two in eu-west, one in us-east) behind real gateways.

Prefix-aware routing raises the fleet's prefix-cache hit rate over round-robin; a replica
SIGKILLed mid-load loses no request that had not started streaming and its broken streams
end with an error event; an EU tenant is never served outside the EU, even with every EU
replica dead. The tests run in file order on one fleet (the last two kill replicas).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_harness import GatewayProc, Proc, free_port, metric_value

from tokenmill.gateway.tenants.tenants import hash_key

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
CHAT = "/v1/chat/completions"


@dataclass
class Replica:
    name: str
    region: str
    url: str
    proc: Proc

    def metric(self, name: str) -> float:
        return metric_value(httpx.get(self.url + "/metrics", timeout=10).text, name)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Replica]]:
    tmp = tmp_path_factory.mktemp("fleet")
    replicas: dict[str, Replica] = {}
    try:
        for name, region in (("eu-1", "eu-west"), ("eu-2", "eu-west"), ("us-1", "us-east")):
            port = free_port()
            cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", MODEL, "--port", str(port),
                   "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024",
                   "--drain-timeout", "2"]
            url = f"http://127.0.0.1:{port}"
            # One torch thread each: three replicas share the machine's two cores.
            proc = Proc(cmd, tmp / f"{name}.log", url + "/health", env={"OMP_NUM_THREADS": "1"})
            replicas[name] = Replica(name, region, url, proc)
        for replica in replicas.values():
            deadline = time.monotonic() + 300
            while httpx.get(replica.url + "/ready", timeout=10).status_code != 200:
                assert time.monotonic() < deadline, f"{replica.name} not ready"
                time.sleep(0.1)
        yield replicas
    finally:
        for replica in replicas.values():
            replica.proc.kill()


def gateway_config(pools: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "gateway": {"region": "eu-west"},
        "regions": {"eu-west": {"residency": "eu", "neighbors": ["us-east"]}, "us-east": {"residency": "us"}},
        "models": [{"name": MODEL}],
        "pools": pools,
        "tenants": [
            {"name": "eu-co", "api_key_sha256": [hash_key("k-eu")], "residency": ["eu"]},
            {"name": "anyone", "api_key_sha256": [hash_key("k-any")]},
        ],
        "health": {"interval_s": 0.5, "timeout_s": 2.0, "failure_threshold": 2, "open_s": 60},
        # Two cores serve the whole fleet: let requests wait for a slot rather than be shed.
        "priorities": {"classes": {"interactive": {"queue_timeout_s": 120}}},
        "cache": {"enabled": False},
    }


def backends(*replicas: Replica) -> list[dict[str, Any]]:
    return [{"url": r.url, "name": r.name, "max_inflight": 8} for r in replicas]


def fleet_hit_rate(replicas: list[Replica], run: Any) -> tuple[float, Any]:
    """(prefix-cache hits / queries over the replicas during `run()`, what run returned)."""
    def totals() -> tuple[float, float]:
        q = sum(r.metric("tokenmill:prefix_cache_queries_total") for r in replicas)
        h = sum(r.metric("tokenmill:prefix_cache_hits_total") for r in replicas)
        return q, h

    q0, h0 = totals()
    result = run()
    q1, h1 = totals()
    return (h1 - h0) / (q1 - q0), result


def conversations(gw: GatewayProc, nonce: str) -> dict[int, set[str]]:
    """6 system prompts x 3 questions, each conversation's questions in a row (round-robin
    then sends the 3 turns of a conversation to 3 different replicas). With 6, all of them
    hashing onto one replica (which the spread check below would fail on) has odds 3 / 3^6."""
    served: dict[int, set[str]] = {}
    with gw.client("k-any", timeout=120) as client:
        for i in range(6):
            system = f"{nonce} desk {i}. " + f"You are assistant number {i} of the support desk; answer briefly. " * 4
            for j in range(3):
                messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Question {j}: hi?"}]
                r = client.post(CHAT, json={"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                served.setdefault(i, set()).add(r.headers["x-tokenmill-backend"])
    return served


def test_prefix_aware_routing_raises_the_fleet_hit_rate(fleet: dict[str, Replica], tmp_path: Path) -> None:
    replicas = list(fleet.values())
    rates = {}
    for policy in ("round_robin", "prefix_aware"):
        pool = {"name": "all", "model": MODEL, "region": "eu-west", "policy": policy, "backends": backends(*replicas)}
        gw = GatewayProc(tmp_path, gateway_config([pool]), name=policy)
        try:
            rates[policy], served = fleet_hit_rate(replicas, lambda gw=gw: conversations(gw, uuid.uuid4().hex))
        finally:
            gw.stop()
        if policy == "prefix_aware":
            assert all(len(names) == 1 for names in served.values()), served
            assert len(set().union(*served.values())) >= 2  # and the conversations spread
    assert rates["prefix_aware"] >= 1.5 * rates["round_robin"], rates
    assert rates["prefix_aware"] > 0.5, rates


def read_stream(text: str) -> tuple[str, list[dict[str, Any]]]:
    frames = [f[len("data: "):] for f in text.split("\n\n") if f.startswith("data: ")]
    assert frames and frames[-1] == "[DONE]", text[-300:]
    events = [json.loads(f) for f in frames[:-1]]
    errors = [e for e in events if "error" in e]
    if errors:
        return "error", errors
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in events), text[-300:]
    return "complete", events


def test_sigkill_mid_load_loses_no_request_that_had_not_started_streaming(
    fleet: dict[str, Replica], tmp_path: Path
) -> None:
    eu1, eu2 = fleet["eu-1"], fleet["eu-2"]
    pool = {"name": "eu", "model": MODEL, "region": "eu-west", "policy": "least_load", "backends": backends(eu1, eu2)}
    gw = GatewayProc(tmp_path, gateway_config([pool]))

    async def load() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=180, headers={"Authorization": "Bearer k-any"}) as client:
            def send(i: int, stream: bool) -> Any:
                messages = [{"role": "user", "content": f"Request {i}: tell me a long story about the sea."}]
                body = {"model": MODEL, "messages": messages, "max_tokens": 24, "stream": stream, "ignore_eos": True}
                return asyncio.create_task(client.post(CHAT, json=body))

            plain = [send(i, False) for i in range(10)]
            streams = [send(100 + i, True) for i in range(4)]
            # Kill once eu-2 is decoding several of them (a fixed delay let a fast machine
            # finish every request first).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                text = (await client.get(eu2.url + "/metrics")).text
                if metric_value(text, "tokenmill:num_requests_running") >= 3:
                    break
            eu2.proc.proc.send_signal(signal.SIGKILL)
            return list(await asyncio.gather(*plain)), list(await asyncio.gather(*streams))

    try:
        plain, streams = asyncio.run(load())
        eu2.proc.proc.wait(10)
        assert [r.status_code for r in plain] == [200] * len(plain), [r.text for r in plain if r.status_code != 200]
        assert all(r.json()["usage"]["completion_tokens"] == 24 for r in plain)
        assert {r.headers["x-tokenmill-backend"] for r in plain} == {"eu-1", "eu-2"} or all(
            r.headers["x-tokenmill-backend"] == "eu-1" for r in plain)
        outcomes = [read_stream(s.text) for s in streams]
        for (kind, events), response in zip(outcomes, streams, strict=True):
            assert response.status_code == 200
            if kind == "error":
                assert events[0]["error"]["code"] == "upstream_stream_broken"
                assert response.headers["x-tokenmill-backend"] == "eu-2"
            else:
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"])
                assert text  # a whole answer, ended by its finish_reason and [DONE]
        retried = [r for r in plain if r.headers["x-tokenmill-retries"] == "1"]
        assert retried, "the kill should have caught some requests in flight on eu-2"
        assert all(r.headers["x-tokenmill-backend"] == "eu-1" for r in retried)
    finally:
        gw.stop()


def test_eu_tenant_is_never_served_outside_the_eu_even_with_the_eu_down(
    fleet: dict[str, Replica], tmp_path: Path
) -> None:
    us1 = fleet["us-1"]
    eu = [r for r in fleet.values() if r.region == "eu-west"]
    pools = [
        {"name": "eu", "model": MODEL, "region": "eu-west", "backends": backends(*eu)},
        {"name": "us", "model": MODEL, "region": "us-east", "backends": backends(us1)},
    ]
    gw = GatewayProc(tmp_path, gateway_config(pools))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 2}
    try:
        for replica in eu:
            if replica.proc.proc.poll() is None:
                replica.proc.proc.send_signal(signal.SIGKILL)
                replica.proc.proc.wait(10)
        served_before = us1.metric("tokenmill:prompt_tokens_total")
        with gw.client("k-eu") as client:
            replies = [client.post(CHAT, json=body) for _ in range(3)]
            replies.append(client.post(CHAT, json={**body, "stream": True}))
        assert [r.status_code for r in replies] == [503] * 4, [r.text for r in replies]
        assert all(r.json()["error"]["type"] == "server_error" for r in replies)
        assert us1.metric("tokenmill:prompt_tokens_total") == served_before
        with gw.client("k-any") as client:
            other = client.post(CHAT, json=body)
        assert other.status_code == 200 and other.headers["x-tokenmill-region"] == "us-east"
    finally:
        gw.stop()
