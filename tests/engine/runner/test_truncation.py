import torch

from tokenmill.engine.runner.truncation import top_k_top_p_threshold


def reference_threshold(probs: torch.Tensor, k: int, p: float) -> float:
    values = probs.sort(descending=True).values[:k]
    if p >= 1.0:
        return float(values[-1]) if k < probs.numel() else 0.0
    cumulative = values.cumsum(0)
    num = int((cumulative < p * values.sum()).sum()) + 1
    return float(values[num - 1])


def test_thresholds_match_a_full_sort_for_every_kind_of_row():
    vocab = 4000
    gen = torch.Generator().manual_seed(0)
    # (top_k or vocab, top_p, logit scale): flat rows need the wider rounds.
    rows = [
        (vocab, 1.0, 1.0),
        (5, 1.0, 1.0),
        (vocab, 0.9, 5.0),
        (vocab, 0.5, 0.2),
        (300, 0.99, 0.5),
    ]
    rows += [(1, 0.3, 1.0), (vocab, 0.999, 3.0), (2000, 0.7, 0.1)]
    probs = torch.stack([(torch.randn(vocab, generator=gen) * s).softmax(-1) for _, _, s in rows])
    top_k = torch.tensor([k for k, _, _ in rows])
    top_p = torch.tensor([p for _, p, _ in rows])
    got = top_k_top_p_threshold(probs, top_k, top_p, max_top_k=2000, any_top_p=True)
    expected = [reference_threshold(probs[i], k, p) for i, (k, p, _) in enumerate(rows)]
    assert got.tolist() == expected


def test_top_k_only_needs_one_round():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.25, 0.25, 0.4, 0.1]])
    got = top_k_top_p_threshold(
        probs, torch.tensor([2, 4]), torch.ones(2), max_top_k=2, any_top_p=False
    )
    assert got.tolist() == [probs[0, 3].item(), 0.0]  # keep {0.4, 0.3}; disabled keeps all
