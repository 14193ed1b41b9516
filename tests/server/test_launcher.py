"""SIGTERM: stop accepting, finish in-flight work up to the drain timeout, exit 0."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import free_port

HERE = Path(__file__).parent


@contextlib.contextmanager
def launched(drain_s: float, step_delay_s: float) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """The launcher subprocess, ready; killed on the way out if a test left it running."""
    proc, base = start(drain_s, step_delay_s)
    try:
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def start(drain_s: float, step_delay_s: float) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parents[1] / "src")])}
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "launcher_main.py"), str(port), str(drain_s), str(step_delay_s)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/ready").status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.communicate()[0]}")
        time.sleep(0.05)


def stream_in_thread(base: str, max_tokens: int, out: list[str], started: threading.Event) -> threading.Thread:
    def consume() -> None:
        body = {"prompt": "ab", "max_tokens": max_tokens, "stream": True}
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
                for line in response.iter_lines():
                    started.set()
                    if line:
                        out.append(line)
        except httpx.TransportError as exc:
            out.append(f"transport error: {exc}")
        started.set()

    thread = threading.Thread(target=consume)
    thread.start()
    return thread


def test_sigterm_drains_in_flight_streams_and_exits_zero() -> None:
    with launched(drain_s=10, step_delay_s=0.02) as (proc, base):
        lines: list[str] = []
        started = threading.Event()
        thread = stream_in_thread(base, 40, lines, started)
        assert started.wait(10)
        proc.send_signal(signal.SIGTERM)
        thread.join(20)
        # The in-flight stream ran to its end.
        assert lines[-1] == "data: [DONE]"
        assert sum('"text":' in line for line in lines) == 40
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out
        assert "engine shut down; aborted=0 finished=1" in out
        # Nothing listens any more.
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health")


def test_drain_timeout_cancels_what_is_left_and_still_exits_zero() -> None:
    with launched(drain_s=1, step_delay_s=0.05) as (proc, base):
        lines: list[str] = []
        started = threading.Event()
        thread = stream_in_thread(base, 200, lines, started)
        assert started.wait(10)
        began = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
        thread.join(10)
        assert proc.returncode == 0, out
        assert time.monotonic() - began < 5
        assert "engine shut down; aborted=1 finished=0" in out
        assert "data: [DONE]" not in lines
