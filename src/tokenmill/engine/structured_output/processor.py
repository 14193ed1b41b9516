"""The built-in structured-output constraint, as a batch logits processor.

Each constrained row holds a Matcher, the live list of the tokens its request has
generated, and how many of them the matcher has consumed. Per step:

    apply:  catch every matcher up with its row's new tokens, fill the packed bitmask of
            all constrained rows in one backend call, apply it in one op (-inf elsewhere)
    finished_rows: rows whose grammar has terminated (the request stops, "stop"); then,
            every matcher standing at the next step's position, that step's bitmask fill
            starts on a worker thread and runs while the model computes the next forward
            (as vLLM and SGLang overlap it with the GPU). apply() uses it when the rows are
            unchanged, and refills otherwise; nothing touches a matcher while it runs.
    failed_rows:   rows that produced a token their grammar refuses (cannot happen through
                   the mask; reported, never passed off as valid output)

A row added with a history (a request resumed after preemption) replays it into a fresh
matcher, so its state is rebuilt rather than carried over.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tokenmill.engine.logits.processor import BatchUpdate, ProcessorContext
from tokenmill.engine.structured_output.backend import Matcher
from tokenmill.engine.structured_output.bitmask import allocate_bitmask, apply_token_bitmask_
from tokenmill.engine.structured_output.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # rows compare by identity (a prefetch is for these very rows)
class _Row:
    matcher: Matcher
    output_token_ids: list[int]
    consumed: int = 0
    failed: bool = False
    # The matcher's is_terminated(), as of its last consumed token.
    terminated: bool = False


class StructuredOutputProcessor:
    name = "structured_outputs"

    def __init__(self, context: ProcessorContext, compiler: GrammarCompiler) -> None:
        self.context = context
        self.compiler = compiler
        self._rows: dict[int, _Row] = {}
        self._bitmask = allocate_bitmask(8, context.vocab_size)
        # The next step's masks, filled on a worker thread while the model runs: the rows
        # they were filled for, and the fill in flight.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-mask")
        self._prefetched: list[tuple[int, _Row]] | None = None
        self._prefetch: Future[None] | None = None
        # Every matcher has consumed its row's history (set by _catch_up; rows only grow
        # between finished_rows calls, which catch up, or arrive with update_state).
        self._caught_up = True
        # The row-index tensor of the last apply, reused while the live rows are the same.
        self._index_rows: list[int] = []
        self._index = torch.zeros(0, dtype=torch.int64)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        self._join()  # the fill in flight reads the matchers about to change hands
        self._prefetched = None
        self._caught_up = False
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
        if not self._caught_up:
            self._catch_up()
        live = self._live()
        if not live:
            return logits
        self._join()
        if self._prefetched != live:
            self._fill(live)  # rows changed since the prefetch (or none ran)
        self._prefetched = None
        indices = [i for i, _ in live]
        if indices != self._index_rows:
            self._index_rows, self._index = indices, torch.tensor(indices, dtype=torch.int64)
        apply_token_bitmask_(logits, self._bitmask[: len(live)], self._index)
        return logits

    def finished_rows(self) -> list[int]:
        self._catch_up()
        finished = [i for i, row in self._rows.items() if row.terminated and not row.failed]
        # Every matcher is now at the next step's position: fill its masks meanwhile.
        live = [(i, row) for i, row in self._rows.items() if not row.failed and not row.terminated]
        if live:
            self._prefetched = live
            self._prefetch = self._pool.submit(self._fill, live)
        return finished

    def num_valid_drafts(self, index: int, drafts: list[int]) -> int:
        """How many leading draft tokens row `index`'s grammar allows from where it stands
        (speculative decoding cuts the rest before verification). Changes nothing."""
        row = self._rows.get(index)
        if row is None:
            return len(drafts)
        self._catch_up()
        self._join()  # the fill in flight reads this matcher
        if row.failed or row.terminated:
            return 0
        return row.matcher.validate_tokens(drafts)

    def failed_rows(self) -> list[int]:
        return [i for i, row in self._rows.items() if row.failed]

    def _live(self) -> list[tuple[int, _Row]]:
        return [(i, row) for i, row in self._rows.items() if not row.failed]

    def _fill(self, live: list[tuple[int, _Row]]) -> None:
        if self._bitmask.shape[0] < len(live):
            self._bitmask = allocate_bitmask(max(len(live), 2 * self._bitmask.shape[0]), self.context.vocab_size)
        bitmask = self._bitmask[: len(live)]
        self.compiler.backend.fill_bitmask([(row.matcher, k) for k, (_, row) in enumerate(live)], bitmask)

    def _join(self) -> None:
        if self._prefetch is not None:
            self._prefetch.result()
            self._prefetch = None

    def _catch_up(self) -> None:
        """Feed every matcher the tokens its row produced since; rows one token behind
        (every decoding row, each step) go to the backend as one batch."""
        pending = [r for r in self._rows.values() if not r.failed and r.consumed < len(r.output_token_ids)]
        self._caught_up = True
        if not pending:
            return
        self._join()  # a fill in flight must not see a matcher move
        self._prefetched = None  # and a finished one is stale
        while pending:
            for row in pending:
                if row.terminated:  # EOS after the grammar's end: nothing left to match
                    row.consumed = len(row.output_token_ids)
            pending = [r for r in pending if r.consumed < len(r.output_token_ids)]
            if not pending:
                return
            tokens = [r.output_token_ids[r.consumed] for r in pending]
            accepted = self.compiler.backend.accept_tokens(list(zip([r.matcher for r in pending], tokens, strict=True)))
            for row, token, ok in zip(pending, tokens, accepted, strict=True):
                row.consumed += 1
                if ok:
                    row.terminated = row.matcher.is_terminated()
                else:
                    logger.error("a constrained request produced token %d its grammar refuses", token)
                    row.failed = True
            pending = [r for r in pending if not r.failed and r.consumed < len(r.output_token_ids)]
