"""Logits processors that ship with tokenmill (registered as entry points in pyproject).

    no_repeat    forbids the token the row produced last (or the prompt's last token
                 before the first output), optionally only for the first `max_tokens`
                 outputs. A small stateful rule that needs each row's history.
    force_tokens forces the output to start with the given token ids, one per step, then
                 lets the model continue.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tokenmill.engine.logits.processor import BatchUpdate, ProcessorContext


@dataclass
class _History:
    prompt_token_ids: Sequence[int]
    output_token_ids: list[int]
    args: dict[str, Any]


class _RowHistories:
    """Keeps, per batch index, the history and arguments of each row that enabled `name`."""

    name: str

    def __init__(self, context: ProcessorContext) -> None:
        self.context = context
        self._rows: dict[int, _History] = {}

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self._rows = batch_update.remap(self._rows)
        for added in batch_update.added:
            args = added.args_for(self.name)
            if args is not None:
                self._rows[added.index] = _History(added.prompt_token_ids, added.output_token_ids, args)


class NoRepeatPrevious(_RowHistories):
    name = "no_repeat"

    @classmethod
    def validate_args(cls, args: dict[str, Any], context: ProcessorContext) -> None:
        unknown = set(args) - {"max_tokens"}
        if unknown:
            raise ValueError(f"no_repeat takes only max_tokens (got {sorted(unknown)})")
        limit = args.get("max_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ValueError("no_repeat max_tokens must be an integer >= 1")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, previous = [], []
        for index, h in self._rows.items():
            limit = h.args.get("max_tokens")
            if limit is not None and len(h.output_token_ids) >= limit:
                continue
            last = h.output_token_ids[-1] if h.output_token_ids else h.prompt_token_ids[-1]
            rows.append(index)
            previous.append(last)
        if rows:
            logits[torch.tensor(rows), torch.tensor(previous)] = float("-inf")
        return logits


class ForceTokens(_RowHistories):
    name = "force_tokens"

    @classmethod
    def validate_args(cls, args: dict[str, Any], context: ProcessorContext) -> None:
        ids = args.get("token_ids")
        if set(args) != {"token_ids"} or not isinstance(ids, list) or not ids:
            raise ValueError("force_tokens takes token_ids: a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise ValueError("force_tokens token_ids must be non-negative integers")
        if any(t >= context.vocab_size for t in ids):
            raise ValueError(f"force_tokens token_ids must lie in the vocabulary [0, {context.vocab_size})")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, h in self._rows.items():
            forced: list[int] = h.args["token_ids"]
            position = len(h.output_token_ids)
            if position < len(forced):
                keep = logits[index, forced[position]].clone()
                logits[index] = float("-inf")
                logits[index, forced[position]] = keep if torch.isfinite(keep) else 0.0
        return logits
