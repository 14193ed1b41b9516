"""GrammarCompiler: one compile per distinct spec, off the caller's thread, errors cached."""

from __future__ import annotations

import threading

import pytest

from tokenmill.engine.structured_output.compiler import GrammarCompiler
from tokenmill.engine.structured_output.spec import StructuredOutputsParams


class CountingBackend:
    name = "counting"

    def __init__(self) -> None:
        self.compiled: list[tuple[str, str]] = []
        self.threads: set[str] = set()

    def compile(self, spec):
        self.threads.add(threading.current_thread().name)
        self.compiled.append(spec.key)
        if spec.kind == "regex" and spec.regex == "bad":
            raise ValueError("unsupported regex: bad")
        return ("grammar", spec.key)

    def fill_bitmask(self, matchers, bitmask) -> None:
        raise AssertionError("not used")


def test_cache_by_canonical_spec_and_thread() -> None:
    backend = CountingBackend()
    compiler = GrammarCompiler(backend)
    a = StructuredOutputsParams(json={"b": 1, "a": {"type": "object"}})
    same = StructuredOutputsParams(json='{"a": {"type": "object"}, "b": 1}')
    assert compiler.submit(a) is compiler.submit(same)
    assert compiler.compile(a) == ("grammar", ("json", '{"a":{"type":"object"},"b":1}'))
    assert compiler.cached(same) == compiler.compile(a)
    assert backend.compiled == [a.key]
    assert all(t.startswith("tokenmill-grammar") for t in backend.threads)
    assert len(compiler.drain_compile_times()) == 1 and compiler.drain_compile_times() == []
    compiler.shutdown()


def test_failures_are_cached_and_raise_each_time() -> None:
    backend = CountingBackend()
    compiler = GrammarCompiler(backend)
    bad = StructuredOutputsParams(regex="bad")
    for _ in range(2):
        with pytest.raises(ValueError, match="unsupported regex: bad"):
            compiler.compile(bad)
    assert backend.compiled == [("regex", "bad")]
    compiler.shutdown()


def test_lru_bound() -> None:
    backend = CountingBackend()
    compiler = GrammarCompiler(backend, max_entries=2)
    specs = [StructuredOutputsParams(regex=r) for r in ("a", "b", "c")]
    for s in specs:
        compiler.compile(s)
    compiler.compile(specs[2])
    compiler.compile(specs[0])  # evicted: compiled again
    assert backend.compiled == [("regex", "a"), ("regex", "b"), ("regex", "c"), ("regex", "a")]
    compiler.shutdown()
