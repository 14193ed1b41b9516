"""The built-in structured-output constraint, as a batch logits processor.

Each constrained row holds a Matcher, the live list of the tokens its request has
generated, and how many of them the matcher has consumed. Per step:

    mask:   catch every matcher up with its row's new tokens; the packed bitmask of all
            constrained rows, prefetched (below) or filled in one backend call
    apply:  mask, then set it in one op (-inf elsewhere); the runner may instead fuse
            mask() into the logits' float conversion (bitmask.masked_float)
    finished_rows: rows whose grammar has terminated (the request stops, "stop"); then,
            every matcher standing at the next step's position, that step's bitmask fill
            starts on a worker thread and runs while the model computes the next forward
            (as vLLM and SGLang overlap it with the GPU); nothing moves a matcher while it
            runs. Each prefetched mask is kept by its row (the _Row itself, whatever index
            the batch gives it next), so a step that removes or moves rows uses the
            prefetch as it is, and one that adds rows fills only theirs.
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


@dataclass(eq=False)  # rows hash by identity (a prefetched mask belongs to this very row)
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
        # The next step's masks, filled on a worker thread while the model runs: the
        # bitmask row of each row filled at its matcher's current position (an entry goes
        # when its matcher moves or mask() hands the masks out), and the fill in flight.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-mask")
        self._slots: dict[_Row, int] = {}
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
        # The fill in flight may go on: it reads only its rows' matchers, which no remap
        # moves (a removed row's mask is simply never used).
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
        mask = self.mask()
        if mask is not None:
            apply_token_bitmask_(logits, *mask)
        return logits

    def mask(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This step's packed masks ([m, words] int32) and the batch rows they belong to
        ([m] int64), or None when no row is constrained. Valid until the next call."""
        if not self._caught_up:
            self._catch_up()
        live = self._live()
        if not live:
            return None
        self._join()
        slots, self._slots = self._slots, {}  # handed out: valid for this step only
        missing = [row for _, row in live if row not in slots]
        if missing:  # rows added since the prefetch (or none ran): one fill for them all
            start = max(slots.values(), default=-1) + 1
            self._fill(missing, start)
            slots.update((row, start + k) for k, row in enumerate(missing))
        masks = [slots[row] for _, row in live]
        indices = [i for i, _ in live]
        if indices != self._index_rows:
            self._index_rows, self._index = indices, torch.tensor(indices, dtype=torch.int64)
        if masks == list(range(len(masks))):  # the usual step: the prefetch, in order
            return self._bitmask[: len(masks)], self._index
        return self._bitmask[torch.tensor(masks, dtype=torch.int64)], self._index

    def finished_rows(self) -> list[int]:
        self._catch_up()
        finished = [i for i, row in self._rows.items() if row.terminated and not row.failed]
        # Every matcher is now at the next step's position: fill its masks meanwhile.
        live = [row for row in self._rows.values() if not row.failed and not row.terminated]
        self._join()
        self._slots = {row: k for k, row in enumerate(live)}
        if live:
            self._prefetch = self._pool.submit(self._fill, live, 0)
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

    def _fill(self, rows: list[_Row], start: int) -> None:
        """Fill bitmask rows start, start + 1, ... with the masks of `rows`, in one call."""
        end = start + len(rows)
        if self._bitmask.shape[0] < end:  # grow, keeping the rows filled so far
            grown = allocate_bitmask(max(end, 2 * self._bitmask.shape[0]), self.context.vocab_size)
            grown[: self._bitmask.shape[0]] = self._bitmask
            self._bitmask = grown
        self.compiler.backend.fill_bitmask(
            [(row.matcher, start + k) for k, row in enumerate(rows)], self._bitmask[:end]
        )

    def _join(self) -> None:
        if self._prefetch is not None:
            self._prefetch.result()
            self._prefetch = None

    def _catch_up(self) -> None:
        """Feed every matcher the tokens its row produced since; rows one token behind
        (every decoding row, each step) go to the backend as one batch."""
        pending = [r for r in self._rows.values() if r.consumed < len(r.output_token_ids) and not r.failed]
        self._caught_up = True
        if not pending:
            return
        self._join()  # a fill in flight must not see a matcher move
        for row in pending:  # and the masks filled for where they stood are stale
            self._slots.pop(row, None)
        advance = self.compiler.backend.advance
        while pending:
            batch = []
            for row in pending:
                if row.terminated:  # EOS after the grammar's end: nothing left to match
                    row.consumed = len(row.output_token_ids)
                else:
                    batch.append(row)
            if not batch:
                return
            results = advance([(r.matcher, r.output_token_ids[r.consumed]) for r in batch])
            for row, terminated in zip(batch, results, strict=True):
                row.consumed += 1
                if terminated is None:
                    token = row.output_token_ids[row.consumed - 1]
                    logger.error("a constrained request produced token %d its grammar refuses", token)
                    row.failed = True
                else:
                    row.terminated = terminated
            pending = [r for r in batch if not r.failed and r.consumed < len(r.output_token_ids)]
