"""The runner's persistent view of the requests it is computing.

Each request the scheduler has handed over owns a row of preallocated numpy arrays: its
token ids (prompt, then generated tokens appended by the runner itself), counts, and its
block table. A step reads only those arrays, with vectorized gathers, so preparing the
inputs costs the same few numpy calls whether the batch holds 1 request or 64.

    token_ids   [max_num_seqs, max_model_len]       int32
    block_table [max_num_seqs, max_blocks_per_req]  int32   (row r, logical block b -> id)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.runner.attention import AttentionMetadata
from tokenmill.engine.scheduler_output import CachedRequestData, NewRequestData


@dataclass
class Spans:
    """Consecutive positions [start, start + length) of some rows, flattened into one batch
    of T tokens (row r owns tokens query_start[r]:query_start[r + 1])."""

    positions: np.ndarray  # int64 [T]
    token_rows: np.ndarray  # int64 [T], the batch row of each token
    query_start: np.ndarray  # int64 [R + 1]
    slot_mapping: np.ndarray  # int64 [T], the KV slot of each position

    def metadata(self, batch: InputBatch, rows: np.ndarray, seq_lens: np.ndarray, device: torch.device) -> AttentionMetadata:
        """Attention metadata for these spans, each row's context ending at seq_lens."""
        block_size = batch.block_size
        max_blocks = int(-(-seq_lens.max() // block_size))
        return AttentionMetadata.build(
            block_table=torch.from_numpy(batch.block_table[rows, :max_blocks]).to(device),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
            query_start_loc=torch.from_numpy(self.query_start.astype(np.int32)).to(device),
            slot_mapping=torch.from_numpy(self.slot_mapping).to(device),
            max_query_len=int(np.diff(self.query_start).max()),
            block_size=block_size,
        )


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_blocks = -(-max_model_len // block_size)
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)
        # Draft tokens of this step (speculative decoding), stored in token_ids right
        # after the row's tokens but not counted in num_tokens.
        self.num_drafts = np.zeros(max_num_seqs, dtype=np.int32)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def __len__(self) -> int:
        return len(self.row_of)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.row_of

    def add(self, new: NewRequestData) -> int:
        assert new.req_id not in self.row_of, f"request {new.req_id} already in the batch"
        assert self._free_rows, "more requests than max_num_seqs reached the runner"
        row = self._free_rows.pop()
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_drafts[row] = 0
        self.num_blocks[row] = 0
        self._append_blocks(row, new.block_ids)
        self.row_of[new.req_id] = row
        return row

    def update(self, cached: CachedRequestData) -> None:
        row = self.row_of[cached.req_id]
        self.num_blocks[row] = cached.num_kept_blocks
        self._append_blocks(row, cached.new_block_ids)
        self.num_computed_tokens[row] = cached.num_computed_tokens
        self.num_drafts[row] = 0

    def set_drafts(self, req_id: str, drafts: list[int]) -> None:
        """This step's draft tokens for a row (after `update`)."""
        row = self.row_of[req_id]
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(drafts)] = drafts
        self.num_drafts[row] = len(drafts)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Append one sampled token to each of `rows`."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def append_token_list(self, row: int, token_ids: list[int]) -> None:
        """Append a row's tokens of one step (accepted drafts and the sampled token)."""
        n = int(self.num_tokens[row])
        self.token_ids[row, n : n + len(token_ids)] = token_ids
        self.num_tokens[row] = n + len(token_ids)
        self.num_drafts[row] = 0

    def spans(self, rows: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> Spans:
        """Positions starts[i] .. starts[i] + lengths[i] - 1 of each rows[i], with slots."""
        cu = np.cumsum(lengths)
        query_start = np.zeros(len(rows) + 1, np.int64)
        query_start[1:] = cu
        req_of_token = np.repeat(np.arange(len(rows)), lengths)
        positions = starts[req_of_token] + np.arange(int(cu[-1])) - query_start[req_of_token]
        token_rows = rows[req_of_token]
        block_ids = self.block_table[token_rows, positions // self.block_size]
        slot_mapping = block_ids.astype(np.int64) * self.block_size + positions % self.block_size
        return Spans(positions, token_rows, query_start, slot_mapping)

    def prompt_token_ids(self, req_id: str) -> np.ndarray:
        row = self.row_of[req_id]
        return self.token_ids[row, : self.num_prompt_tokens[row]]

    def output_token_ids(self, req_id: str) -> np.ndarray:
        row = self.row_of[req_id]
        return self.token_ids[row, self.num_prompt_tokens[row] : self.num_tokens[row]]

    def _append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)
