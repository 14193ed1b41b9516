"""LogitsProcessorPipeline: the runner's host for batch logits processors.

The runner tells the pipeline which requests joined its batch (`add`, with their params)
and which left (`remove`). Each step, `apply(logits, req_ids)` turns the change in the
step's sampled rows (row i of logits is req_ids[i]) into one BatchUpdate for every
processor, then lets each transform the logits, custom processors first and the
structured-output constraint last (so nothing can re-enable a token the grammar forbids).
After sampling, `record(tokens)` appends each row's token to its live history and asks the
processors which rows must stop (grammar end) or failed.

When no request of the batch names a custom processor, the grammar is the step's only
processing, and `grammar_mask(req_ids)` stands in for apply: it brings the processors up
to date the same way and returns the constraint's bitmask, which the runner fuses into
the logits' bfloat16 -> float32 conversion (the mask then costs no pass of its own).

A step in which no request of the batch uses any processor costs one integer check: the
processors see no rows then (every row is removed from them when the last user leaves),
and rows are added back, with their history read from the runner, when a user returns. A
request removed and added again (preempted, resumed) is a new row: rows are keyed by
(req_id, generation).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tokenmill.engine.logits.processor import AddedRow, BatchUpdate, ProcessorContext
from tokenmill.engine.request import SamplingParams

# req_id -> (prompt token ids, output token ids) as the runner holds them now.
HistoryFn = Callable[[str], tuple[list[int], list[int]]]


class LogitsProcessorPipeline:
    def __init__(
        self,
        processors: dict[str, Any],
        context: ProcessorContext,
        history: HistoryFn,
        structured: Any | None = None,
    ) -> None:
        self.context = context
        self._custom = processors
        self._structured = structured
        self._order = [*processors.values(), *([structured] if structured is not None else [])]
        self._history = history
        self._params: dict[str, SamplingParams] = {}
        self._generation: dict[str, int] = {}
        self._generations = itertools.count()
        self._users = 0  # requests in the runner's batch that use any processor
        self._custom_users = 0  # those that name a custom processor
        self._batch: list[tuple[str, int]] = []  # rows the processors hold, by index
        self._outputs: list[list[int]] = []  # live output history of each row

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._custom)

    def validate(self, params: SamplingParams) -> None:
        """Raise ValueError for a processor name nobody registered or bad arguments."""
        for spec in params.logits_processors:
            processor = self._custom.get(spec.name)
            if processor is None:
                known = ", ".join(sorted(self._custom)) or "none"
                raise ValueError(f"unknown logits processor {spec.name!r} (registered: {known})")
            validate = getattr(type(processor), "validate_args", None)
            if validate is not None:
                validate(spec.args, self.context)
        if params.structured_outputs is not None and self._structured is None:
            raise ValueError("structured outputs need a tokenizer, and this engine has none")

    @property
    def active(self) -> bool:
        return self._users > 0 or bool(self._batch)

    def add(self, req_id: str, params: SamplingParams) -> None:
        self._params[req_id] = params
        self._generation[req_id] = next(self._generations)
        if _uses_processors(params):
            self._users += 1
        if params.logits_processors:
            self._custom_users += 1

    def remove(self, req_id: str) -> None:
        params = self._params.pop(req_id, None)
        self._generation.pop(req_id, None)
        if params is not None and params.logits_processors:
            self._custom_users -= 1
        if params is not None and _uses_processors(params):
            self._users -= 1
            if self._users == 0 and self._batch:
                self._send(BatchUpdate(0, removed=list(range(len(self._batch)))))
                self._batch, self._outputs = [], []

    def apply(self, logits: torch.Tensor, req_ids: Sequence[str]) -> torch.Tensor:
        """Every processor's transform of the step's logits ([len(req_ids), vocab])."""
        if self._users == 0:
            return logits
        rows = [(r, self._generation[r]) for r in req_ids]
        update = None if rows == self._batch else self._diff(rows)
        self._send(update)
        for processor in self._order:
            logits = processor.apply(logits)
        return logits

    def grammar_mask(self, req_ids: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """In place of apply() when the grammar is the only processing this step: the
        constraint's (bitmask [m, words], rows [m]) for logits rows in req_ids order, None
        when nothing is constrained. Only while grammar_only."""
        if self._custom_users:
            raise RuntimeError("custom logits processors are in use: call apply()")
        if self._users == 0 or self._structured is None:
            return None
        rows = [(r, self._generation[r]) for r in req_ids]
        self._send(None if rows == self._batch else self._diff(rows))
        return self._structured.mask()

    @property
    def grammar_only(self) -> bool:
        """Whether grammar_mask() may stand in for apply() (no custom processor in use)."""
        return self._custom_users == 0

    def record(
        self, token_ids: Sequence[int], rows: Sequence[int] | None = None
    ) -> tuple[list[str], list[str]]:
        """Append this step's sampled tokens: one per row of the last apply, or one per
        index of `rows` (the rows that took a token; speculative verification walks a
        request's drafts one apply at a time). Returns the req_ids to stop (their grammar
        ended) and those that failed."""
        if not self._batch:
            return [], []
        if rows is None:
            for history, token in zip(self._outputs, token_ids, strict=True):
                history.append(token)
        else:
            for row, token in zip(rows, token_ids, strict=True):
                self._outputs[row].append(token)
        stopped: list[str] = []
        failed: list[str] = []
        for processor in self._order:
            for method, into in (("finished_rows", stopped), ("failed_rows", failed)):
                rows = getattr(processor, method, None)
                if rows is not None:
                    into.extend(self._batch[i][0] for i in rows())
        return stopped, failed

    @property
    def has_constraints(self) -> bool:
        """Whether a grammar constraint is installed (see num_valid_drafts)."""
        return self._structured is not None

    def num_valid_drafts(self, req_id: str, drafts: list[int]) -> int:
        """How many leading drafts the request's grammar allows (all, unconstrained)."""
        assert self._structured is not None
        key = (req_id, self._generation.get(req_id))
        for index, row in enumerate(self._batch):
            if row == key:
                return int(self._structured.num_valid_drafts(index, drafts))
        return len(drafts)

    def _diff(self, rows: list[tuple[str, int]]) -> BatchUpdate:
        old = {key: i for i, key in enumerate(self._batch)}
        new = set(rows)
        update = BatchUpdate(len(rows))
        update.removed = [i for key, i in old.items() if key not in new]
        outputs: list[list[int]] = []
        for i, key in enumerate(rows):
            j = old.get(key)
            if j is not None:
                if j != i:
                    update.moved.append((j, i))
                outputs.append(self._outputs[j])
                continue
            prompt, output = self._history(key[0])
            outputs.append(output)
            update.added.append(AddedRow(i, key[0], self._params[key[0]], prompt, output))
        self._batch, self._outputs = rows, outputs
        return update

    def _send(self, update: BatchUpdate | None) -> None:
        for processor in self._order:
            processor.update_state(update)


def _uses_processors(params: SamplingParams) -> bool:
    return params.structured_outputs is not None or bool(params.logits_processors)
