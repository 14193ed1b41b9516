"""A request's parameters and its life inside the engine.

A Request is owned by the scheduler. `num_computed_tokens` counts the tokens whose K/V are
in the cache; the scheduler advances it until it catches up with `num_tokens` (prompt +
generated). There is no separate prefill or decode phase: a step simply computes the
tokens a request is missing.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokenmill.engine.logits.processor import LogitsProcessorSpec
from tokenmill.engine.structured_output.spec import StructuredOutputsParams


class FinishReason(enum.Enum):
    """Why a request ended, as the API reports it."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller

    def __str__(self) -> str:
        return self.value


class RequestStatus(enum.IntEnum):
    """Explicit state machine. WAITING -> RUNNING <-> PREEMPTED -> FINISHED_*."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status in _FINISHED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH_CAPPED,
        RequestStatus.FINISHED_ABORTED,
    }
)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}

# Bounds on what one request may ask for.
MAX_N = 128
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop. Shaped as vLLM's SamplingParams.

    Disabled knobs are None (top_k, seed, logprobs), never -1 sentinels.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    # Number of top alternatives to return per generated token (the chosen one is always
    # returned too); None for no logprobs.
    logprobs: int | None = None
    # Same, for every prompt token after the first.
    prompt_logprobs: int | None = None
    # token id -> bias added to its logit before sampling.
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    # The output must match this (a JSON schema, regex, choice or grammar); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # Batch logits processors this request enables, by registered name with arguments.
    logits_processors: list[LogitsProcessorSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}]", self.n)
        _check(self.temperature >= 0.0, "temperature must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", self.top_p)
        if self.top_k is not None and self.top_k <= 0:
            # 0 and -1 are the ecosystem's spellings of "disabled".
            _check(self.top_k in (0, -1), "top_k must be >= 1 (or 0/-1 to disable)", self.top_k)
            self.top_k = None
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]", self.frequency_penalty)
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]", self.repetition_penalty)
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens must be >= 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens must be >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(0 <= value <= MAX_LOGPROBS, f"{name} must be in [0, {MAX_LOGPROBS}]", value)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty", self.stop)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0", self.stop_token_ids)
        if self.logit_bias:
            for tok, bias in self.logit_bias.items():
                _check(isinstance(tok, int) and tok >= 0, "logit_bias keys must be token ids", tok)
                _check(-100.0 <= bias <= 100.0, "logit_bias values must be in [-100, 100]", bias)
        self.logits_processors = [_processor_spec(spec) for spec in self.logits_processors or []]
        if self.structured_outputs is not None and (self.stop or self.stop_token_ids):
            # A stop sequence could cut the constrained output mid-structure and report it
            # as a clean "stop": refused rather than returned invalid.
            raise ValueError(
                "stop and stop_token_ids cannot be combined with structured outputs "
                "(a stop sequence could cut the constrained output mid-structure)"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def child(self, index: int) -> SamplingParams:
        """Params of the index-th of n parallel samples: n=1, a distinct derived seed."""
        import dataclasses

        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


def _processor_spec(spec: object) -> LogitsProcessorSpec:
    """A logits processor named as a string, {"name": ..., "args": {...}} or a spec."""
    if isinstance(spec, LogitsProcessorSpec):
        return spec
    if isinstance(spec, str) and spec:
        return LogitsProcessorSpec(spec)
    if isinstance(spec, dict) and isinstance(spec.get("name"), str) and set(spec) <= {"name", "args"}:
        args = spec.get("args") or {}
        _check(isinstance(args, dict), "logits processor args must be an object", args)
        return LogitsProcessorSpec(spec["name"], dict(args))
    raise ValueError(f'a logits processor is a name or {{"name": ..., "args": {{...}}}} (got {spec!r})')


def _check(ok: bool, message: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{message} (got {value!r})")


class Request:
    """One sequence in the engine: prompt, generated tokens and scheduling state."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.priority = priority
        self.cache_salt = cache_salt
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        # All tokens, prompt then output; K/V exist for the first num_computed_tokens.
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first scheduling.
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        # Draft tokens proposed for the next step (speculative decoding); not yet tokens.
        self.spec_token_ids: list[int] = []
        self.stop_reason: int | str | None = None
        # Timestamps for metrics (monotonic seconds); None until they happen.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
