"""The proposer seam: where draft tokens come from.

    Proposer.propose(req_ids, num_drafts) -> {req_id: drafts}     after a step's sampling
    Proposer.remove(req_id)                                        the request left the batch
    Proposer.drain_timings() -> [(rows, seconds)]                  its model forwards, if any

One file per implementation: ngram.py (prompt lookup, no model), draft_model.py (a smaller
model, or the target's first layers). Proposals are deterministic tokens; verification
(rejection.py) makes the output exactly the target's whatever they are.
"""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    def propose(self, req_ids: list[str], num_drafts: list[int]) -> dict[str, list[int]]: ...

    def remove(self, req_id: str) -> None: ...

    def drain_timings(self) -> list[tuple[int, float]]:
        """(rows, seconds) of the model forwards it ran since the last call."""
        ...
