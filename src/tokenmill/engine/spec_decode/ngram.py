"""Prompt lookup (n-gram) proposals: copy what followed the sequence's own last tokens.

For a sequence t[0..L), try suffix lengths n from `max_n` down to `min_n`: find an earlier
occurrence of the suffix t[L-n..L), starting at i < L - n, and propose the (up to) k tokens
that followed it, t[i+n : i+n+k]. The occurrence is the most recent one with k tokens after
it (the freshest context), else the earliest (the longest continuation). The longest suffix with a match
wins: a longer context is a better predictor. Nothing is proposed when no suffix recurs.
This is the home ground of copying and editing workloads (quoting the prompt, rewriting a
paragraph, code edits), and it costs no model forward.

Per sequence the search is a few vectorized numpy comparisons: the positions where the
suffix's first token occurs, then the candidates compared on the remaining n - 1 tokens.
"""

from __future__ import annotations

import numpy as np

from tokenmill.engine.runner.input_batch import InputBatch


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to k tokens predicted to follow `tokens` (1-D int array), or []."""
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Occurrences start at i <= length - n - 1, so at least one token follows them.
            starts = np.flatnonzero(tokens[: length - n] == suffix[0])
            for offset in range(1, n):
                if not len(starts):
                    break
                starts = starts[tokens[starts + offset] == suffix[offset]]
            if len(starts):
                # The latest occurrence with k tokens after it; else the earliest (in a
                # loop, the latest one runs into the suffix itself after a few tokens).
                full = starts[starts <= length - n - k]
                i = int(full[-1]) if len(full) else int(starts[0])
                return tokens[i + n : i + n + k].tolist()
        return []


class NgramLookup:
    """The Proposer over the runner's token arrays."""

    def __init__(self, batch: InputBatch, min_n: int, max_n: int) -> None:
        self.batch = batch
        self.ngram = NgramProposer(min_n, max_n)

    def propose(self, req_ids: list[str], num_drafts: list[int]) -> dict[str, list[int]]:
        batch, out = self.batch, {}
        for req_id, k in zip(req_ids, num_drafts, strict=True):
            row = batch.row_of[req_id]
            drafts = self.ngram.propose(batch.token_ids[row, : batch.num_tokens[row]], k)
            if drafts:
                out[req_id] = drafts
        return out

    def remove(self, req_id: str) -> None:
        pass

    def drain_timings(self) -> list[tuple[int, float]]:
        return []
