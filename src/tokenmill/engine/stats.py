"""Engine statistics, taken every step. The server's /metrics reads these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    # Gauges: the state after the step.
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    # Counters since the engine started (tokens for the prefix cache).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_steps: int = 0
    # This step.
    num_scheduled_tokens: int = 0
    # Speculative decoding, since the engine started: drafts verified and accepted, and
    # how many verifications accepted 0, 1, 2, ... drafts.
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_acceptance_lengths: tuple[int, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (cached-but-free blocks count as free)."""
        if self.num_kv_blocks_total == 0:
            return 0.0
        return self.num_kv_blocks_used / self.num_kv_blocks_total
