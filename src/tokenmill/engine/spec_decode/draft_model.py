"""A draft model proposer: a smaller model (or the target's first layers) run greedily.

Its argmax, one token per forward, k forwards for k drafts, batched over the requests
that propose. Its K/V lives in paged blocks addressed by the target's block tables (the
same block ids, so prefix sharing, preemption and freeing need nothing of its own):

  * a separate checkpoint gets its own KV tensors of the target's block count. Its K/V
    is caught up lazily: when a request proposes, the draft first runs the tokens it has
    not seen (the whole prompt the first time, then the few tokens accepted since) as one
    chunk, whose last position gives the first draft. A request that never speculates
    (large batches) costs the draft nothing.
  * "self" (the target's first L layers, its final norm and head) shares the target's KV
    cache: its layers' K/V for every verified token is exactly what the target wrote, so
    only the drafts themselves are computed. Its draft K/V lands in the lookahead slots
    the scheduler reserved past the verified tokens, which the next verification
    overwrites.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from tokenmill.engine.models.llama import Attention, LlamaForCausalLM
from tokenmill.engine.runner.attention import AttentionMetadata
from tokenmill.engine.runner.input_batch import InputBatch

# Binds the draft's attention to its KV cache for one forward's metadata.
BindFn = Callable[[AttentionMetadata], Attention]


class DraftModel:
    def __init__(
        self,
        model: LlamaForCausalLM,
        batch: InputBatch,
        bind: BindFn,
        device: torch.device,
        num_layers: int | None = None,
        shares_target_kv: bool = False,
    ) -> None:
        """`num_layers`: run only the model's first layers (a self-draft); with
        `shares_target_kv` the bound KV cache is the target's."""
        self.model = model
        self.batch = batch
        self.bind = bind
        self.device = device
        self.num_layers = num_layers
        self.shares_target_kv = shares_target_kv
        # req_id -> tokens whose K/V the draft holds (own KV only).
        self._num_computed: dict[str, int] = {}
        # (rows, seconds) of each draft forward since the last drain_timings().
        self._timings: list[tuple[int, float]] = []

    def drain_timings(self) -> list[tuple[int, float]]:
        timings, self._timings = self._timings, []
        return timings

    @torch.inference_mode()
    def propose(self, req_ids: list[str], num_drafts: list[int]) -> dict[str, list[int]]:
        batch = self.batch
        # Draft i is written at position num_tokens - 1 + i: only into reserved slots.
        room = [
            int(batch.num_blocks[batch.row_of[r]]) * batch.block_size - int(batch.num_tokens[batch.row_of[r]]) + 1
            for r in req_ids
        ]
        reqs = [(r, min(k, n)) for r, k, n in zip(req_ids, num_drafts, room, strict=True) if min(k, n) > 0]
        if not reqs:
            return {}
        rows = np.array([batch.row_of[r] for r, _ in reqs], np.int64)
        num_tokens = batch.num_tokens[rows].astype(np.int64)
        # First forward: the tokens the draft has not seen, ending at the last token.
        if self.shares_target_kv:
            starts = num_tokens - 1
        else:
            starts = np.array([self._num_computed.get(r, 0) for r, _ in reqs], np.int64)
        next_tokens = self._forward(rows, starts, num_tokens)
        drafts: dict[str, list[int]] = {r: [t] for (r, _), t in zip(reqs, next_tokens, strict=True)}
        if not self.shares_target_kv:
            for (r, _), n in zip(reqs, num_tokens.tolist(), strict=True):
                self._num_computed[r] = n
        ks = np.array([k for _, k in reqs])
        for i in range(1, int(ks.max())):
            live = np.flatnonzero(ks > i)
            # Draft i sits at position num_tokens - 1 + i, fed the previous draft.
            positions = num_tokens[live] - 1 + i
            inputs = [drafts[reqs[j][0]][-1] for j in live]
            out = self._forward(rows[live], positions, positions + 1, inputs)
            for j, t in zip(live.tolist(), out, strict=True):
                drafts[reqs[j][0]].append(t)
        return drafts

    def remove(self, req_id: str) -> None:
        self._num_computed.pop(req_id, None)

    def _forward(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        input_ids: list[int] | None = None,
    ) -> list[int]:
        """One draft forward over positions [starts[r], ends[r]) of each row (their
        tokens from the batch, or `input_ids` for single positions past the tokens);
        returns the argmax after each row's last position."""
        batch, dev = self.batch, self.device
        spans = batch.spans(rows, starts, ends - starts)
        positions = spans.positions
        if input_ids is None:
            ids = batch.token_ids[spans.token_rows, positions].astype(np.int64)
        else:
            ids = np.asarray(input_ids, np.int64)
        metadata = spans.metadata(batch, rows, ends, dev)
        begin = time.perf_counter()
        hidden = self.model(
            torch.from_numpy(ids).to(dev), torch.from_numpy(positions).to(dev),
            self.bind(metadata), self.num_layers,
        )
        last = torch.from_numpy(spans.query_start[1:] - 1).to(dev)
        tokens = self.model.compute_logits(hidden[last]).argmax(dim=-1).tolist()
        if input_ids is not None:  # single-position forwards: what the policy prices
            self._timings.append((len(rows), time.perf_counter() - begin))
        return tokens
