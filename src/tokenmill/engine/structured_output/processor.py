"""The built-in structured-output constraint, as a batch logits processor.

Each constrained row holds a Matcher, the live list of the tokens its request has
generated, and how many of them the matcher has consumed. Per step:

    apply:  catch every matcher up with its row's new tokens, fill the packed bitmask of
            all constrained rows in one backend call, apply it in one op (-inf elsewhere)
    finished_rows: rows whose grammar has terminated (the request stops, "stop")
    failed_rows:   rows that produced a token their grammar refuses (cannot happen through
                   the mask; reported, never passed off as valid output)

A row added with a history (a request resumed after preemption) replays it into a fresh
matcher, so its state is rebuilt rather than carried over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenmill.engine.logits.processor import BatchUpdate, ProcessorContext
from tokenmill.engine.structured_output.backend import Matcher
from tokenmill.engine.structured_output.bitmask import allocate_bitmask, apply_token_bitmask_
from tokenmill.engine.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass
class _Row:
    matcher: Matcher
    output_token_ids: list[int]
    consumed: int = 0
    failed: bool = False


class StructuredOutputProcessor:
    name = "structured_outputs"

    def __init__(self, context: ProcessorContext, compiler: GrammarCompiler) -> None:
        self.context = context
        self.compiler = compiler
        self._rows: dict[int, _Row] = {}
        self._bitmask = allocate_bitmask(8, context.vocab_size)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self._rows = batch_update.remap(self._rows)
        for added in batch_update.added:
            spec = added.params.structured_outputs
            if spec is None:
                continue
            # Compiled before the request was accepted: a cache hit.
            matcher = self.compiler.compile(spec).matcher()
            self._rows[added.index] = _Row(matcher, added.output_token_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        # logits: [batch, vocab] float32
        self._catch_up()
        live = [(i, row) for i, row in self._rows.items() if not row.failed]
        if not live:
            return logits
        if self._bitmask.shape[0] < len(live):
            self._bitmask = allocate_bitmask(max(len(live), 2 * self._bitmask.shape[0]), self.context.vocab_size)
        bitmask = self._bitmask[: len(live)]
        self.compiler.backend.fill_bitmask([(row.matcher, k) for k, (_, row) in enumerate(live)], bitmask)
        rows = torch.tensor([i for i, _ in live], dtype=torch.int64)
        apply_token_bitmask_(logits, bitmask, rows)
        return logits

    def finished_rows(self) -> list[int]:
        self._catch_up()
        return [i for i, row in self._rows.items() if not row.failed and row.matcher.is_terminated()]

    def failed_rows(self) -> list[int]:
        return [i for i, row in self._rows.items() if row.failed]

    def _catch_up(self) -> None:
        """Feed every matcher the tokens its row produced since; rows one token behind
        (every decoding row, each step) go to the backend as one batch."""
        while True:
            pending = [r for r in self._rows.values() if not r.failed and r.consumed < len(r.output_token_ids)]
            if not pending:
                return
            for row in pending:
                if row.matcher.is_terminated():  # EOS after the grammar's end: nothing to match
                    row.consumed = len(row.output_token_ids)
            pending = [r for r in pending if r.consumed < len(r.output_token_ids)]
            if not pending:
                return
            tokens = [r.output_token_ids[r.consumed] for r in pending]
            accepted = self.compiler.backend.accept_tokens([(r.matcher, t) for r, t in zip(pending, tokens, strict=True)])
            for row, token, ok in zip(pending, tokens, accepted, strict=True):
                row.consumed += 1
                if not ok:
                    logger.error("a constrained request produced token %d its grammar refuses", token)
                    row.failed = True
