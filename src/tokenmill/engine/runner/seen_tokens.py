"""The tokens each row has seen (prompt and output), for repetition-style penalties.

Penalties touch only the tokens a request has seen, a few hundred or thousand out of the
vocabulary, so they are stored sparsely: row r's distinct tokens sit in columns of
padded [rows, width] tensors, with how often each occurred in the output.

    ids     [rows, width] int64    token id of each column (0 in padding)
    counts  [rows, width] float32  occurrences in the output (0: prompt only)
    valid   [rows, width] bool     False in padding

Applying the penalties gathers the seen logits, penalizes them, and scatter-adds the
difference back (padding adds 0), so a step costs O(rows x width), not O(rows x vocab).
A Python map per row (token -> column) places appended tokens.
"""

from __future__ import annotations

import torch


class SeenTokens:
    """Per-row distinct prompt + output tokens and their output counts."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.device = device
        self.ids = torch.zeros(max_rows, 0, dtype=torch.int64, device=device)
        self.counts = torch.zeros(max_rows, 0, dtype=torch.float32, device=device)
        self.valid = torch.zeros(max_rows, 0, dtype=torch.bool, device=device)
        # row -> token id -> column, for the rows that track their tokens.
        self._columns: dict[int, dict[int, int]] = {}

    def __contains__(self, row: object) -> bool:
        return row in self._columns

    def set_row(self, row: int, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """Start tracking a row from its prompt and the outputs it already has."""
        columns = dict.fromkeys([*prompt_token_ids, *output_token_ids], 0)
        for column, token in enumerate(columns):
            columns[token] = column
        self._ensure_width(len(columns))
        self.clear_row(row)
        self._columns[row] = columns
        n = len(columns)
        counts = [0.0] * n
        for token in output_token_ids:
            counts[columns[token]] += 1.0
        self.ids[row, :n] = torch.tensor(list(columns), dtype=torch.int64)
        self.counts[row, :n] = torch.tensor(counts, dtype=torch.float32)
        self.valid[row, :n] = True

    def clear_row(self, row: int) -> None:
        if self._columns.pop(row, None) is not None:
            self.ids[row].zero_()
            self.counts[row].zero_()
            self.valid[row].fill_(False)

    def append(self, rows: list[int], token_ids: list[int]) -> None:
        """Count one output token per entry (rows not tracked are skipped)."""
        count_rows, count_columns = [], []
        new_rows, new_columns, new_ids = [], [], []
        for row, token in zip(rows, token_ids, strict=True):
            columns = self._columns.get(row)
            if columns is None:
                continue
            column = columns.get(token)
            if column is None:
                column = columns[token] = len(columns)
                new_rows.append(row)
                new_columns.append(column)
                new_ids.append(token)
            count_rows.append(row)
            count_columns.append(column)
        if not count_rows:
            return
        if new_rows:
            self._ensure_width(max(new_columns) + 1)
            index = (self._index(new_rows), self._index(new_columns))
            self.ids.index_put_(index, self._index(new_ids))
            self.valid.index_put_(
                index, torch.ones(len(new_rows), dtype=torch.bool, device=self.device)
            )
        ones = torch.ones(len(count_rows), dtype=torch.float32, device=self.device)
        index = (self._index(count_rows), self._index(count_columns))
        self.counts.index_put_(index, ones, accumulate=True)

    def apply_penalties(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor | slice,
        repetition: torch.Tensor | None,
        frequency: torch.Tensor | None,
        presence: torch.Tensor | None,
    ) -> None:
        """In place on logits [n, vocab] (row i is tracked row rows[i]): the repetition
        penalty (HF/vLLM, over prompt + output: a positive logit is divided by it, a
        negative one multiplied), then OpenAI's penalties over the output:
        logit -= frequency * count, then logit -= presence * (count > 0). Penalties [n, 1];
        None when no row uses that kind."""
        ids, counts, valid = self.ids[rows], self.counts[rows], self.valid[rows]
        seen = logits.gather(1, ids)  # [n, width]
        penalized = seen
        if repetition is not None:
            penalized = torch.where(seen > 0, seen / repetition, seen * repetition)
        if frequency is not None:
            penalized = penalized - frequency * counts
        if presence is not None:
            penalized = penalized - presence * (counts > 0)
        # -inf (a token min_tokens holds back) stays -inf: its delta would be NaN.
        delta = torch.where(valid & seen.isfinite(), penalized - seen, 0.0)
        logits.scatter_add_(1, ids, delta)

    def _ensure_width(self, width: int) -> None:
        old = self.ids.shape[1]
        if width <= old:
            return
        new = max(width, 2 * old, 64)
        self.ids = _widen(self.ids, new)
        self.counts = _widen(self.counts, new)
        self.valid = _widen(self.valid, new)

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def _widen(tensor: torch.Tensor, width: int) -> torch.Tensor:
    wider = torch.zeros(tensor.shape[0], width, dtype=tensor.dtype, device=tensor.device)
    wider[:, : tensor.shape[1]] = tensor
    return wider
