"""What the model runner hands back to the scheduler each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LogprobsTensors:
    """Logprobs of one token position per row, as tensors (converted lazily off the hot path).

    Row i: the chosen (or prompt) token first, then the top-k alternatives.
    """

    # token_ids: [num_rows, 1 + k] int64; logprobs: [num_rows, 1 + k] float32
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    # rank of the chosen token among all tokens (1 = most likely): [num_rows] int64
    ranks: torch.Tensor


@dataclass
class ModelRunnerOutput:
    # Requests that sampled a token this step, in batch order (a request mid-way through a
    # chunked prefill samples nothing).
    req_ids: list[str] = field(default_factory=list)
    # Per entry of req_ids, the tokens it took this step: its accepted draft tokens (when
    # it speculated), then the token sampled after them. Never empty.
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # A row per sampled token (req_ids order, then token order), or None when no request
    # in the batch asked for logprobs.
    logprobs: LogprobsTensors | None = None
    # req_id -> logprobs of the prompt tokens computed this step (positions 1.. of the prompt).
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    # Requests whose grammar reached its end with this step's token (they stop, "stop"),
    # and those whose token their grammar refused (they end as aborted).
    stopped_req_ids: set[str] = field(default_factory=set)
    failed_req_ids: set[str] = field(default_factory=set)
    # req_id -> draft tokens proposed for the next step (speculative decoding).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Seconds the target forward took (None where it is not measured synchronously).
    forward_seconds: float | None = None
