"""The engine's client interface: the only door the server uses.

AsyncEngine implements it in-process; a future multi-process or remote engine implements
the same Protocol, so the server never changes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.stats import SchedulerStats


@dataclass(frozen=True)
class EngineHealth:
    # The background loop is running (it has not crashed or been stopped).
    alive: bool
    # Weights loaded and warmed up: the engine can take requests.
    ready: bool
    # Monotonic time of the last completed step, None before the first.
    last_step_time: float | None
    # Requests waiting or running.
    has_work: bool
    # Why the loop died, when it did.
    error: str | None = None


class EngineClient(Protocol):
    model_config: ModelConfig
    tokenizer: Tokenizer
    # Longest prompt + output a request may reach.
    max_model_len: int

    def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request; yield RequestOutput *deltas* as tokens arrive.

        Each delta carries, per progressed sample (`outputs[i].index`), only the new text,
        token ids and logprobs; the last one has `finished=True` and finish reasons. A
        string prompt is tokenized as is (no chat template, no special tokens added).
        Raises ValueError, before yielding anything, for a request the engine can never
        serve (prompt too long, never fits the KV cache). Closing the iterator early
        (client gone) aborts the request and frees its blocks.
        """
        ...

    async def prepare(self, sampling_params: SamplingParams) -> None:
        """Check, before anything is streamed, what a request asks of the engine beyond
        its prompt: its grammar (compiled off the engine thread and cached, so generate()
        does not pay again) and its logits processors' names and arguments. Raises
        ValueError (the caller's error) when the engine cannot honor them."""
        ...

    def drain_grammar_compile_times(self) -> list[float]:
        """Seconds of each grammar compile since the last call (cache hits excluded)."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request; its KV blocks are freed within one step."""
        ...

    async def embed(self, token_ids: list[list[int]]) -> list[list[float]]:
        """Mean-pooled, L2-normalized last hidden states, one vector per input."""
        ...

    def stats(self) -> SchedulerStats:
        """Statistics as of the last completed step."""
        ...

    def health(self) -> EngineHealth: ...

    async def shutdown(self) -> None: ...
