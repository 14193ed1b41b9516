"""One API call's engine requests, merged into one stream; and their collected result.

A call has one engine request per prompt (chat: one; completions: one per prompt in a
list), each with `n` samples. Choice `prompt_index * n + sample_index` is the API's choice
index, as OpenAI and vLLM number them.

Lifetime rules, all in `stream()`'s `finally`: whatever ends the call (completion, an
error, the client closing the SSE stream, a cancelled task after a disconnect) aborts
every engine request that has not finished, under a shielded cancel scope so the abort
itself cannot be cancelled; the admission ticket is released; finished requests feed the
latency metrics, aborted ones the `abort` count. A ValueError from the engine (a request
it can never serve) becomes a 400.

With a constraint, the call counts once in `structured_output_requests_total{kind}`, and
each sample that ends "stop" is re-checked against it (its whole text, accumulated here);
a failure is counted in `structured_output_invalid_total` and logged.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio

from tokenmill.engine.outputs import PositionLogprobs, RequestOutput
from tokenmill.engine.protocol import EngineClient
from tokenmill.engine.request import SamplingParams
from tokenmill.server.admission import AdmissionTicket
from tokenmill.server.constraints import Constraint
from tokenmill.server.errors import invalid
from tokenmill.server.metrics import StreamTiming
from tokenmill.server.state import ServerState

logger = logging.getLogger(__name__)


@dataclass
class ChoiceResult:
    """One choice, accumulated from deltas."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class PromptResult:
    token_ids: list[int]
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class GenerationResult:
    prompts: list[PromptResult]
    choices: list[ChoiceResult]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        return sum(p.num_cached_tokens for p in self.prompts)


class Generation:
    """Submit `prompts` to the engine with `params`; `stream()` yields (prompt_index, delta)."""

    def __init__(
        self,
        state: ServerState,
        engine: EngineClient,
        prompts: list[list[int]],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        self._state = state
        self._constraint = constraint
        self._engine = engine
        self.prompts = prompts
        self.params = params
        self._priority = priority
        self._cache_salt = cache_salt
        base = uuid.uuid4().hex
        self.engine_request_ids = [f"{base}-{i}" for i in range(len(prompts))]
        # Submitted to the engine and not yet finished or aborted.
        self._running = [False] * len(prompts)
        self._timings = [StreamTiming(time.monotonic()) for _ in prompts]
        # Raises a 429 now, before any response has started.
        self._ticket: AdmissionTicket = state.admission.admit(engine.stats().num_waiting_reqs)
        if constraint is not None:
            state.metrics.observe_structured_request(constraint.kind)

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            if len(self.prompts) == 1:
                async for output in self._run(0):
                    yield 0, output
            else:
                async for item in self._merged():
                    yield item
        finally:
            with anyio.CancelScope(shield=True):
                await self.close()

    async def close(self) -> None:
        """Release the admission ticket and abort what still runs. Idempotent.

        Also called by the response wrapper, because a stream cancelled before its first
        step never runs its own `finally`.
        """
        self._ticket.release()
        for index, request_id in enumerate(self.engine_request_ids):
            if self._running[index]:
                self._running[index] = False
                self._state.metrics.observe_aborted(self.params.n)
                await self._engine.abort(request_id)

    async def collect(self) -> GenerationResult:
        """Run to completion and accumulate every choice."""
        n = self.params.n
        result = GenerationResult(
            prompts=[PromptResult(list(ids)) for ids in self.prompts],
            choices=[
                ChoiceResult(index=p * n + i, prompt_index=p)
                for p in range(len(self.prompts))
                for i in range(n)
            ],
        )
        async for prompt_index, output in self.stream():
            prompt = result.prompts[prompt_index]
            prompt.num_cached_tokens = max(prompt.num_cached_tokens, output.num_cached_tokens)
            if output.prompt_logprobs is not None:
                prompt.prompt_logprobs = (prompt.prompt_logprobs or []) + list(output.prompt_logprobs)
            for sample in output.outputs:
                choice = result.choices[prompt_index * n + sample.index]
                choice.text += sample.text
                choice.token_ids.extend(sample.token_ids)
                if sample.logprobs:
                    choice.logprobs.extend(sample.logprobs)
                if sample.finish_reason is not None:
                    choice.finish_reason = sample.finish_reason
        return result

    async def _run(self, prompt_index: int) -> AsyncIterator[RequestOutput]:
        outputs = self._engine.generate(
            self.prompts[prompt_index],
            self.params,
            self.engine_request_ids[prompt_index],
            priority=self._priority,
            cache_salt=self._cache_salt,
        )
        self._running[prompt_index] = True
        timing = self._timings[prompt_index]
        metrics = self._state.metrics
        # Samples finish in different deltas (a delta carries only those that progressed).
        finish_reasons: list[str] = []
        # Sample index -> text so far, kept only to re-check a constrained output.
        texts: dict[int, str] = {}
        try:
            async for output in outputs:
                self._ticket.started()
                metrics.observe_output(timing, time.monotonic())
                finish_reasons += [o.finish_reason for o in output.outputs if o.finish_reason]
                if self._constraint is not None:
                    self._check_outputs(self._constraint, output, texts)
                if output.finished:
                    self._running[prompt_index] = False
                    metrics.observe_finished(finish_reasons, output.metrics, timing)
                yield output
                if output.finished:
                    return
        except ValueError as exc:
            # The engine refusing a request it can never serve: the caller's error.
            raise invalid(str(exc)) from None
        finally:
            aclose = getattr(outputs, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()

    def _check_outputs(self, constraint: Constraint, output: RequestOutput, texts: dict[int, str]) -> None:
        for sample in output.outputs:
            text = texts.get(sample.index, "") + sample.text
            texts[sample.index] = text
            if sample.finish_reason == "stop" and not constraint.holds(text):
                self._state.metrics.observe_structured_invalid()
                logger.warning(
                    "constrained output (%s) ended 'stop' but fails its re-check: request %s sample %d",
                    constraint.kind, output.request_id, sample.index,
                )

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Interleave several prompts' streams in arrival order."""
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for output in self._run(index):
                    await queue.put((index, output))
                await queue.put(None)
            except Exception as exc:  # handed to the consumer, which re-raises it
                await queue.put(exc)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(*tasks, return_exceptions=True)

