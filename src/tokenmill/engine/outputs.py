"""What leaves the engine: per-step core outputs and the public RequestOutput.

EngineCoreOutput is token-level (scheduler.update produces it); the output processor turns
it into RequestOutput with text, applying stop strings and incremental detokenization.
Shaped as vLLM's outputs so users can switch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.request import FinishReason


@dataclass
class Logprob:
    logprob: float
    # 1 = the most likely token.
    rank: int
    decoded_token: str | None = None


# One position: token id -> Logprob, chosen token first, then the top alternatives.
PositionLogprobs = dict[int, Logprob]


@dataclass
class EngineCoreOutput:
    """One request's progress in one step."""

    req_id: str
    new_token_ids: list[int]
    # One entry per new token when logprobs were asked for.
    new_logprobs: list[PositionLogprobs] | None = None
    # Prompt logprobs computed this step (first entry of the whole list is None: the first
    # prompt token has no logprob).
    new_prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request, if any.
    stop_reason: int | str | None = None
    # Stopped because the output completed its structured-output grammar: the last new
    # token is content, not a stop token.
    grammar_ended: bool = False
    num_cached_tokens: int = 0
    # Monotonic time the scheduler first gave the request compute (queue time ends).
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One of a request's n samples. Cumulative in final outputs, a delta when streamed."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    # "stop" or "length" (or "abort"); None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended it.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (seconds) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
