"""The batch logits processor protocol.

A processor is constructed once per engine. Every step in which some request of the batch
uses a processor, the engine first tells each processor how the batch changed since the
last call, then hands it the whole batch's logits:

    update_state(BatchUpdate | None)   None: same rows as last time
    apply(logits [batch, vocab]) -> logits     (may modify in place)
    finished_rows() -> indices          optional: rows whose request must stop now
                                        (called after the step's tokens are recorded)

Row i of `logits` is batch index i. A BatchUpdate is applied in one go, as a simultaneous
reassignment: drop every index in `removed`, move each (old, new) pair of `moved` (all
moves read the old numbering), then create each `added` row. Indices not mentioned keep
their row. A request mid-way through a chunked prefill has no logits yet, so it is not in
the batch; it is added with the step that samples its first token. A request preempted and
resumed is removed, then added again with its token history as it stands (its state is
rebuilt from that history, never carried over).

`AddedRow.output_token_ids` is live: the engine appends each token the row samples, so a
processor reads the history it needs at apply() without copying it per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from tokenmill.engine.request import SamplingParams


@dataclass(frozen=True)
class LogitsProcessorSpec:
    """A request's use of a processor: its registered name and the request's arguments."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class AddedRow:
    index: int
    req_id: str
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    # Live: grows by one each step this row samples.
    output_token_ids: list[int]

    def args_for(self, name: str) -> dict[str, Any] | None:
        """The request's arguments for processor `name`, or None when it did not ask."""
        for spec in self.params.logits_processors:
            if spec.name == name:
                return spec.args
        return None


@dataclass
class BatchUpdate:
    batch_size: int
    removed: list[int] = field(default_factory=list)
    moved: list[tuple[int, int]] = field(default_factory=list)
    added: list[AddedRow] = field(default_factory=list)

    def remap(self, states: dict[int, Any]) -> dict[int, Any]:
        """`states` (index -> per-row state) renumbered by removed and moved. The caller
        then inserts states for `added`."""
        dropped = set(self.removed)
        moved_from = {old for old, _ in self.moved}
        kept = {i: s for i, s in states.items() if i not in dropped and i not in moved_from}
        for old, new in self.moved:
            if old in states and old not in dropped:
                kept[new] = states[old]
        return kept


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor may need about the engine it runs in."""

    vocab_size: int
    device: torch.device
    eos_token_ids: tuple[int, ...]


@runtime_checkable
class LogitsProcessor(Protocol):
    """Construct with `cls(context)`; an optional classmethod `validate_args(args, context)`
    raises ValueError for a request's bad arguments before the request is accepted."""

    def update_state(self, batch_update: BatchUpdate | None) -> None: ...

    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...
