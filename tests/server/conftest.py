"""Fixtures: the app over a FakeEngine, in-process (TestClient) or on a real socket."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi import FastAPI
from fastapi.testclient import TestClient
from server_harness import ThreadedServer

from tokenmill.server.app import build_app
from tokenmill.server.settings import ServerSettings

MODEL = "fake-model"


def make_app(engine: FakeEngine | None, **settings: Any) -> FastAPI:
    return build_app(engine, ServerSettings(served_model_name=MODEL, model="fake/path", **settings))


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(make_app(engine), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def make_client() -> Iterator[Callable[..., TestClient]]:
    clients: list[TestClient] = []

    def make(engine: FakeEngine | None, **settings: Any) -> TestClient:
        c = TestClient(make_app(engine, **settings), raise_server_exceptions=False)
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def live_server(engine: FakeEngine) -> Iterator[ThreadedServer]:
    with ThreadedServer(make_app(engine)) as server:
        yield server

