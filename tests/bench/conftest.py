"""Bench fixtures: tokenmill's real server app over the server tests' FakeEngine, on a socket.

The FakeEngine and the threaded uvicorn harness live in tests/server; they are put on the
import path here rather than copied.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

from fake_engine import FakeEngine
from server_harness import ThreadedServer

from tokenmill.server.app import build_app
from tokenmill.server.settings import ServerSettings

MODEL = "fake-model"


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine(max_model_len=4096, step_delay_s=0.002)


@pytest.fixture
def fake_server(fake_engine: FakeEngine) -> Iterator[ThreadedServer]:
    app = build_app(fake_engine, ServerSettings(served_model_name=MODEL, model="fake/path"))
    with ThreadedServer(app) as server:
        yield server
