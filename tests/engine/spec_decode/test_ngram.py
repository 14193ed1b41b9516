from __future__ import annotations

import numpy as np
import pytest

from tokenmill.engine.spec_decode.ngram import NgramProposer


def propose(tokens, k, lo=1, hi=3):
    return NgramProposer(lo, hi).propose(np.array(tokens, np.int32), k)


@pytest.mark.parametrize(
    "tokens,k,expected",
    [
        ([1, 2, 3, 4, 5, 6, 1, 2, 3], 3, [4, 5, 6]),  # suffix 1 2 3 recurs: what followed it
        ([1, 2, 3, 4, 5, 6, 1, 2, 3], 10, [4, 5, 6, 1, 2, 3]),  # capped by the sequence's end
        ([9, 8, 1, 5, 7, 1, 6, 7, 1], 2, [6, 7]),  # 7 1 recurs (latest with 2 after it)
        ([1, 2, 3], 4, []),  # nothing recurs
        ([5], 4, []),
        ([4, 4, 4, 4], 0, []),
    ],
)
def test_proposals(tokens, k, expected) -> None:
    assert propose(tokens, k) == expected


def test_longest_suffix_wins_over_a_more_recent_short_match() -> None:
    # Suffix "2 3" occurs at 1 (followed by 7 7) and its last token 3 also at 5 (then 9).
    tokens = [1, 2, 3, 7, 7, 3, 9, 9, 2, 3]
    assert propose(tokens, 2, lo=1, hi=2) == [7, 7]
    assert propose(tokens, 2, lo=1, hi=1) == [9, 9]


def test_in_a_loop_the_earliest_occurrence_gives_the_full_continuation() -> None:
    tokens = [5, 6] * 4
    # The latest occurrences of "5 6" run into the suffix; the earliest has k tokens after.
    assert propose(tokens, 4, lo=2, hi=2) == [5, 6, 5, 6]


def test_min_n_bounds_the_match() -> None:
    assert propose([1, 2, 9, 2], 2, lo=2, hi=3) == []
    assert propose([1, 2, 9, 2], 2, lo=1, hi=3) == [9, 2]
