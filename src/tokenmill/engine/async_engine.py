"""The asyncio front door: requests arrive at any time, tokens stream back as they appear.

The engine loop runs on its own thread, because a step is seconds-scale blocking compute
(torch releases the GIL inside kernels, so the HTTP event loop keeps serving). The two
sides talk through two channels only:

    asyncio side  --commands (add / abort / embed)-->  engine thread (owns EngineCore)
    asyncio side  <--RequestOutput deltas (call_soon_threadsafe)--  engine thread

Every mutation of the EngineCore and the OutputProcessor happens on the engine thread, so
neither needs locks. A request whose consumer goes away (the async generator is closed)
is aborted through the command channel, and its blocks are freed before the next step.
A step that raises fails the requests in flight, not the engine: they get the error, the
loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.core import EngineCore
from tokenmill.engine.engine_args import DEFAULT_MODEL, EngineArgs
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.protocol import EngineHealth
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.stats import SchedulerStats

logger = logging.getLogger(__name__)

# The idle loop wakes this often to refresh its heartbeat (health checks read it).
_IDLE_WAKE_S = 0.5


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException | None]

    def put(self, item: RequestOutput | BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, core: EngineCore, tokenizer: Tokenizer) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.model_config = core.config.model
        self.max_model_len = core.config.scheduler.max_model_len
        self._processor = OutputProcessor(tokenizer)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stats = core.stats()
        self._heartbeat: float | None = None
        self._error: str | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Set by from_args: the loading thread waits on it before running the loop.
        self._go: threading.Event | None = None

    @classmethod
    def from_args(cls, model: str = DEFAULT_MODEL, **kwargs: Any) -> AsyncEngine:
        """Load weights and warm up on the engine thread itself (blocking: call it in a
        thread from async code); the loop starts with start().

        One thread does all of the engine's torch work, loading included. With OpenMP, every
        thread that runs parallel torch ops owns a team of workers; two live teams on two
        cores put libgomp into throttled mode, where workers sleep between parallel regions
        and each of a step's ~900 regions pays a wake-up: measured 2.7x slower decode steps
        (17 -> 49 ms at batch 1) when the loop ran on a different thread than the loading.
        """
        built: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()
        go = threading.Event()

        def engine_thread() -> None:
            try:
                core, tokenizer = EngineArgs(model=model, **kwargs).create_engine()
            except BaseException as exc:
                built.put(exc)
                return
            engine = cls(core, tokenizer)
            engine._go = go
            built.put(engine)
            go.wait()
            if not engine._stopping:
                engine._run()

        thread = threading.Thread(target=engine_thread, name="tokenmill-engine", daemon=True)
        thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        result._thread = thread
        return result

    async def start(self) -> None:
        if self._go is not None:
            self._go.set()  # the thread that loaded the engine runs its loop
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ client API
    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self._check_running()
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids = self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        loop = asyncio.get_running_loop()
        await self.prepare(sampling_params)
        stream = _Stream(loop, asyncio.Queue())
        added: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            try:
                self._add(request_id, text, token_ids, sampling_params, priority, cache_salt)
            except Exception as exc:  # validation: reported to the caller, engine unharmed
                loop.call_soon_threadsafe(_set_exception, added, exc)
                return
            self._streams[request_id] = stream
            loop.call_soon_threadsafe(_set_result, added, None)

        self._submit(add)
        await added
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if item is None:  # aborted through abort()
                    finished = True
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._submit(lambda: self._abort(request_id))

    async def prepare(self, sampling_params: SamplingParams) -> None:
        """Validate the request's logits processors and wait for its grammar on the
        compile thread, not the engine thread: the batch keeps stepping meanwhile, and a
        grammar that cannot be enforced raises ValueError here, before the request exists."""
        self.core.runner.processors.validate(sampling_params)
        spec = sampling_params.structured_outputs
        compiler = self.core.grammar_compiler
        if spec is not None and compiler is not None:
            await asyncio.wrap_future(compiler.submit(spec))

    def drain_grammar_compile_times(self) -> list[float]:
        """Seconds of each grammar compile since the last call (cache hits excluded)."""
        compiler = self.core.grammar_compiler
        return compiler.drain_compile_times() if compiler is not None else []

    async def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    async def embed(self, token_ids: list[list[int]]) -> list[list[float]]:
        self._check_running()
        for ids in token_ids:
            self.core.check_token_ids(ids)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[list[float]]] = loop.create_future()

        def run() -> None:
            try:
                vectors = [self.core.embed(ids) for ids in token_ids]
            except Exception as exc:
                loop.call_soon_threadsafe(_set_exception, done, exc)
                return
            loop.call_soon_threadsafe(_set_result, done, vectors)

        self._submit(run)
        return await done

    def stats(self) -> SchedulerStats:
        return self._stats

    def health(self) -> EngineHealth:
        alive = self._thread is not None and self._thread.is_alive() and self._error is None
        return EngineHealth(
            alive=alive,
            ready=alive and self._heartbeat is not None,
            last_step_time=self._heartbeat,
            has_work=bool(self._streams) or not self._commands.empty(),
            error=self._error,
        )

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._go is not None:
            self._go.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._heartbeat = time.monotonic()
                self._drain_commands()
                if self.core.has_unfinished_requests():
                    self._step()
                else:
                    self._wakeup.wait(_IDLE_WAKE_S)
                    self._wakeup.clear()
        except BaseException as exc:  # the loop itself broke: report, fail everyone
            logger.exception("engine loop died")
            self._error = f"{type(exc).__name__}: {exc}"
            self._fail_all(RuntimeError(f"engine loop died: {self._error}"))
        finally:
            self._fail_all(RuntimeError("engine stopped"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()
            self._stats = self.core.stats()

    def _step(self) -> None:
        try:
            outputs = self.core.step()
            deltas, stopped = self._processor.process(outputs)
            if stopped:
                self.core.finish_requests(stopped)
        except Exception as exc:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._streams))
            for request_id in list(self._streams):
                self._abort(request_id, error=RuntimeError(f"engine step failed: {exc}"))
            return
        finally:
            self._stats = self.core.stats()
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.finished:
                del self._streams[delta.request_id]
            stream.put(delta)

    def _add(
        self,
        request_id: str,
        text: str | None,
        token_ids: list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
    ) -> None:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = self._processor.add_request(request_id, text, token_ids, params)
        try:
            self.core.add_samples(
                samples, token_ids, eos_token_ids=self.tokenizer.eos_token_ids,
                priority=priority, cache_salt=cache_salt,
            )
        except Exception:
            self._processor.abort(request_id)
            raise

    def _abort(self, request_id: str, error: BaseException | None = None) -> None:
        self.core.abort_requests(self._processor.abort(request_id))
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(error)

    def _fail_all(self, error: BaseException) -> None:
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id)
            stream.put(error)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _check_running(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the engine is not running")


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
