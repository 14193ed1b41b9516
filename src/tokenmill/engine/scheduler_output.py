"""What the scheduler hands the model runner each step.

Running requests travel as diffs: a request the runner has not seen (new, or resumed after
preemption) comes whole in `new_reqs`; one it already holds comes as `cached_reqs`, carrying
only the blocks appended this step. The runner keeps each request's token ids itself and
appends the tokens it samples, so generated tokens never travel back down.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.request import SamplingParams


@dataclass
class NewRequestData:
    """A request entering the runner's batch (first time, or resumed after preemption)."""

    req_id: str
    # Prompt then every token generated so far (a resumed request recomputes them).
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    # Tokens whose K/V are already in `block_ids` (prefix-cache hits).
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request already in the runner's batch: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Blocks of the request kept before new_block_ids (fewer than the runner holds when
    # rejected speculative tokens' blocks were given back).
    num_kept_blocks: int


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step (1 for a decode, a chunk for a prefill).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests the runner must drop before this step: finished, aborted or preempted
    # since the previous step.
    finished_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding. req_id -> draft tokens verified this step: they follow the
    # request's last token and count in num_scheduled_tokens (1 + drafts for a decode).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> how many drafts to propose after this step (for the next one).
    num_spec_to_propose: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
