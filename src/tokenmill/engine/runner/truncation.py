"""top_k and top_p as one probability threshold per row, without a vocabulary sort.

top_k keeps the k largest probabilities; top_p then keeps the fewest largest whose mass
reaches top_p of what top_k kept (HF/vLLM order: top-k, then top-p over the renormalised
top-k distribution). Both are "keep p >= the m-th largest p" for some m, so each row
needs only its m largest probabilities. Those come from `topk` over a few candidates
(64: most nucleus sizes), widened (1024, then the whole vocabulary) only for the rows
whose top_p mass lies further out. A full sort of 64 x 49152 costs ~134 ms on the 2-core
CPU, a top-64 ~3.4 ms and a top-1024 ~16 ms.
"""

from __future__ import annotations

import torch

# Candidates examined per row for top_p, widest last (then the whole vocabulary).
_TOP_P_CANDIDATES = (64, 1024)


def top_k_top_p_threshold(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    max_top_k: int,
    any_top_p: bool,
) -> torch.Tensor:
    """Per row, the smallest probability to keep: the k-th largest for top_k, and for
    top_p the smallest of the fewest largest probabilities (of the top-k distribution)
    whose mass reaches top_p. Ties with the threshold are kept. Rows with neither get 0.

    The largest probabilities are examined in widening rounds of candidates; each round
    only takes the rows whose top_p mass it did not reach, the last one the whole row."""
    # probs: [n, vocab]; top_k: [n] (vocab when disabled); top_p: [n]
    n, vocab = probs.shape
    threshold = torch.zeros(n, dtype=probs.dtype, device=probs.device)
    rounds = sorted({min(vocab, max(max_top_k, c)) for c in _TOP_P_CANDIDATES} | {vocab})
    if not any_top_p:
        rounds = rounds[:1]
    rows = torch.arange(n, device=probs.device)
    totals = probs.sum(dim=-1)
    for width in rounds:
        candidates = probs if rows.numel() == n else probs[rows]
        values = candidates.topk(width, dim=-1).values  # [m, width] descending
        kth, reached = _cut(values, top_k[rows], top_p[rows], totals[rows], vocab)
        threshold[rows] = kth
        if bool(reached.all()):
            break
        rows = rows[~reached]
    return threshold


def _cut(
    values: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    totals: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Thresholds from each row's largest `width` probabilities (width >= every enabled
    top_k), and whether they sufficed (top_p's mass reached within them)."""
    # values: [m, width] descending; top_k, top_p, totals: [m]
    width = values.shape[1]
    has_k = top_k < vocab
    keep = torch.where(has_k, top_k, width)  # candidates top_k allows
    cumulative = values.cumsum(dim=-1)
    # The mass top_p is a fraction of: the top-k mass, or the whole row's.
    mass = torch.where(has_k, cumulative.gather(1, (keep - 1)[:, None])[:, 0], totals)
    allowed = torch.arange(width, device=values.device)[None, :] < keep[:, None]
    short = (cumulative < (top_p * mass)[:, None]) & allowed  # mass not reached yet
    has_p = top_p < 1.0
    num = torch.where(has_p, short.sum(dim=-1) + 1, keep).clamp(max=width)
    kth = values.gather(1, (num - 1)[:, None])[:, 0]
    kth = torch.where(has_k | has_p, kth, torch.zeros_like(kth))
    reached = ~has_p | has_k | ~short[:, -1] | (width == vocab)
    return kth, reached
