"""Real processes for gateway tests: stub backends and `tokenmill gateway` on free ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).parents[2]
STUB = Path(__file__).with_name("stub_backend.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(extra or {})}


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not up in time:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


class Proc:
    def __init__(self, cmd: list[str], log: Path, probe: str, env: dict[str, str] | None = None) -> None:
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=_env(env), stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_http(probe, self.proc, log)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


class Stub(Proc):
    def __init__(self, tmp: Path, name: str, delay_s: float = 0.0) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, str(STUB), "--port", str(self.port), "--name", name, "--delay-s", str(delay_s)]
        super().__init__(cmd, tmp / f"stub-{name}.log", self.url + "/health")

    def configure(self, **settings: Any) -> None:
        httpx.post(self.url + "/stub/config", json=settings, timeout=5).raise_for_status()

    def requests(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/stub/requests", timeout=5).json())


class GatewayProc(Proc):
    def __init__(self, tmp: Path, config: dict[str, Any], name: str = "gateway") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        cmd = [sys.executable, "-m", "tokenmill.cli.main", "gateway", "--config", str(path),
               "--port", str(self.port), "--log-level", "info"]
        super().__init__(cmd, tmp / f"{name}.log", self.url + "/health")

    def client(self, key: str | None = None, timeout: float = 30.0) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
