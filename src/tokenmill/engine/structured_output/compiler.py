"""Compiles grammars off the engine thread, once per distinct spec.

`submit(spec)` returns a future at once: a spec seen before (same kind and canonical
text) shares the cached future, finished or not; a new one is compiled on the single
worker thread. Callers that can wait asynchronously (the AsyncEngine awaits the future
before handing the request to the engine thread) never stall the batch; `compile(spec)`
is the blocking form for the offline API. A spec that fails to compile fails the same way
each time, so failures are cached too. The cache keeps the `max_entries` most recently
used specs.

Each cold compile's duration is recorded for the metrics (`drain_compile_times`).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

from tokenmill.engine.structured_output.backend import CompiledGrammar, GrammarBackend
from tokenmill.engine.structured_output.spec import StructuredOutputsParams


class GrammarCompiler:
    def __init__(self, backend: GrammarBackend, max_entries: int = 1024) -> None:
        self.backend = backend
        self.max_entries = max_entries
        self._cache: OrderedDict[tuple[str, str], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-grammar")
        self._compile_times: list[float] = []

    def submit(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Blocking: the compiled grammar, or the ValueError saying why it cannot be."""
        return self.submit(spec).result()

    def cached(self, spec: StructuredOutputsParams) -> CompiledGrammar | None:
        """The compiled grammar if it is ready (raises its error if it failed), else None."""
        with self._lock:
            future = self._cache.get(spec.key)
        if future is None or not future.done():
            return None
        return future.result()

    def drain_compile_times(self) -> list[float]:
        """Seconds taken by each cold compile since the last call."""
        with self._lock:
            times, self._compile_times = self._compile_times, []
        return times

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            return self.backend.compile(spec)
        finally:
            elapsed = time.perf_counter() - start
            with self._lock:
                self._compile_times.append(elapsed)
