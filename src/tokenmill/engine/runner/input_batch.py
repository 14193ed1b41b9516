"""The runner's persistent view of the requests it is computing.

Each request the scheduler has handed over owns a row of preallocated numpy arrays: its
token ids (prompt, then generated tokens appended by the runner itself), counts, and its
block table. A step reads only those arrays, with vectorized gathers, so preparing the
inputs costs the same few numpy calls whether the batch holds 1 request or 64.

    token_ids   [max_num_seqs, max_model_len]       int32
    block_table [max_num_seqs, max_blocks_per_req]  int32   (row r, logical block b -> id)
"""

from __future__ import annotations

import numpy as np

from tokenmill.engine.scheduler_output import CachedRequestData, NewRequestData


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
