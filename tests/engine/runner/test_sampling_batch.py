import math

import pytest
import torch

from tokenmill.engine.request import SamplingParams
from tokenmill.engine.runner.sampling_batch import SamplingBatch

EOS = 7
# A known distribution over 8 tokens, most likely first.
PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]
LOGITS = [math.log(p) for p in PROBS]


def make_batch(vocab: int = 8, rows: int = 16) -> SamplingBatch:
    return SamplingBatch(rows, vocab, "cpu")


def add(
    batch: SamplingBatch, req_id: str, prompt: list[int] | None = None, outputs=(), **kw
) -> None:
    batch.add(req_id, SamplingParams(max_tokens=100, **kw), prompt or [0], list(outputs), (EOS,))


def known_logits(n: int) -> torch.Tensor:
    return torch.tensor([LOGITS] * n)


def kept(batch: SamplingBatch, req_id: str) -> set[int]:
    probs = batch.probs(known_logits(1), [req_id])[0]
    return set(torch.nonzero(probs > 0).flatten().tolist())


def sampled_counts(batch: SamplingBatch, req_ids: list[str], steps: int) -> torch.Tensor:
    counts = torch.zeros(8, dtype=torch.int64)
    for _ in range(steps):
        tokens, _ = batch.sample(known_logits(len(req_ids)), req_ids)
        counts += torch.bincount(tokens, minlength=8)
    return counts


def test_greedy_rows_are_exact_argmax_even_next_to_sampled_rows():
    torch.manual_seed(0)
    batch = make_batch(vocab=1000)
    add(batch, "g0", temperature=0.0)
    add(batch, "s", temperature=1.0, top_p=0.5)
    add(batch, "g1", temperature=0.0)
    logits = torch.randn(3, 1000)
    expected = logits.argmax(dim=-1)
    tokens, logprobs = batch.sample(logits.clone(), ["g0", "s", "g1"])
    assert logprobs is None
    assert tokens[0] == expected[0] and tokens[2] == expected[2]
    alone = make_batch(vocab=1000)
    add(alone, "g", temperature=0.0)
    assert alone.sample(logits[1:2].clone(), ["g"])[0].tolist() == [expected[1].item()]


def test_top_k_1_is_greedy_at_any_temperature():
    torch.manual_seed(1)
    batch = make_batch(vocab=500)
    for i, t in enumerate([0.3, 1.0, 5.0, 50.0]):
        add(batch, f"r{i}", temperature=t, top_k=1)
    ids = [f"r{i}" for i in range(4)]
    for _ in range(20):
        logits = torch.randn(4, 500)
        assert batch.sample(logits.clone(), ids)[0].tolist() == logits.argmax(-1).tolist()


def test_tiny_temperature_samples_the_argmax():
    batch = make_batch()
    add(batch, "r", temperature=1e-4)
    torch.manual_seed(2)
    assert sampled_counts(batch, ["r"], 200).tolist() == [200, 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"top_k": 3}, {0, 1, 2}),
        ({"top_p": 0.6}, {0, 1}),  # 0.4 + 0.25 reaches 0.6
        ({"top_p": 0.75}, {0, 1, 2}),  # 0.65 < 0.75 <= 0.8
        ({"min_p": 0.3}, {0, 1, 2}),  # keeps p >= 0.12
        ({"min_p": 0.2}, {0, 1, 2, 3}),  # keeps p >= 0.08
        # top_p over the top-k distribution (0.5, 0.3125, 0.1875): 0.5 + 0.3125 reaches 0.7.
        ({"top_k": 3, "top_p": 0.7}, {0, 1}),
        ({"top_k": 5, "min_p": 0.3}, {0, 1, 2}),
        ({"top_k": 100, "top_p": 1.0, "min_p": 0.0}, set(range(8))),
        ({"top_k": 8}, set(range(8))),
    ],
)
def test_truncation_keeps_exactly_the_expected_set(params, expected):
    batch = make_batch()
    add(batch, "r", **params)
    # A second, untruncated row in the same batch must not change the first.
    add(batch, "other", temperature=0.8)
    probs = batch.probs(known_logits(2), ["r", "other"])
    assert set(torch.nonzero(probs[0] > 0).flatten().tolist()) == expected
    total = sum(PROBS[i] for i in expected)
    assert probs[0].tolist() == pytest.approx(
        [PROBS[i] / total if i in expected else 0.0 for i in range(8)], abs=1e-6
    )
    assert torch.count_nonzero(probs[1]).item() == 8


def test_samples_follow_the_truncated_distribution():
    torch.manual_seed(3)
    batch = make_batch(rows=200)
    ids = [f"r{i}" for i in range(200)]
    for r in ids:
        add(batch, r, top_k=3)
    counts = sampled_counts(batch, ids, 50)
    assert counts[3:].sum().item() == 0
    freq = (counts[:3].double() / counts.sum()).tolist()
    assert freq == pytest.approx([0.5, 0.3125, 0.1875], abs=0.02)


def test_untruncated_sampling_reaches_every_token():
    torch.manual_seed(4)
    batch = make_batch(rows=200)
    ids = [f"r{i}" for i in range(200)]
    for r in ids:
        add(batch, r, top_k=100, top_p=1.0, min_p=0.0)
    counts = sampled_counts(batch, ids, 100)
    assert (counts > 0).all()
    assert (counts.double() / counts.sum()).tolist() == pytest.approx(PROBS, abs=0.01)


def test_temperature_scales_logits():
    batch = make_batch()
    add(batch, "r", temperature=0.5)
    probs = batch.probs(known_logits(1), ["r"])[0]
    squared = [p * p for p in PROBS]
    assert probs.tolist() == pytest.approx([s / sum(squared) for s in squared], abs=1e-6)


def processed_logits(batch: SamplingBatch, logits: list[float], req_id: str) -> list[float]:
    """Logits after bias/min_tokens/penalties, read back through the temperature-1 distribution
    (log p_i - log p_0 + logit_0 recovers each logit up to the shift fixed by token 0)."""
    probs = batch.probs(torch.tensor([logits]), [req_id])[0].double()
    return (probs.log() - probs[0].log()).tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    batch = make_batch(vocab=6)
    # prompt holds tokens 1 and 2; output so far holds token 3.
    add(batch, "r", prompt=[1, 2], outputs=[3], repetition_penalty=2.0)
    logits = [0.0, 3.0, -1.0, 1.5, 2.0, -0.5]
    got = processed_logits(batch, logits, "r")
    # 3.0 / 2, -1.0 * 2, 1.5 / 2; tokens 4, 5 untouched.
    assert got == pytest.approx([0.0, 1.5, -2.0, 0.75, 2.0, -0.5], abs=1e-5)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    batch = make_batch(vocab=6)
    add(batch, "r", prompt=[5], outputs=[1, 1], frequency_penalty=0.5, presence_penalty=0.25)
    batch.append_tokens(["r"], [1])
    batch.append_tokens(["r"], [2])
    logits = [0.0, 3.0, 2.0, 1.0, 0.5, 0.5]
    got = processed_logits(batch, logits, "r")
    # token 1 seen 3 times: 3 - 0.5 * 3 - 0.25; token 2 once: 2 - 0.5 - 0.25; prompt token 5 free.
    assert got == pytest.approx([0.0, 1.25, 1.25, 1.0, 0.5, 0.5], abs=1e-5)


def test_penalties_change_the_greedy_choice():
    batch = make_batch(vocab=4)
    add(batch, "r", prompt=[0], temperature=0.0, repetition_penalty=2.0)
    logits = torch.tensor([[2.0, 1.01, 0.0, 0.0]])
    assert batch.sample(logits.clone(), ["r"])[0].tolist() == [1]  # 2.0 / 2 < 1.01
    logits = torch.tensor([[2.0, 0.99, 0.0, 0.0]])
    assert batch.sample(logits.clone(), ["r"])[0].tolist() == [0]


def test_logit_bias_forces_and_bans_tokens():
    torch.manual_seed(5)
    batch = make_batch()
    add(batch, "force", logit_bias={6: 100.0})
    add(batch, "ban", temperature=0.0, logit_bias={0: -100.0})
    for _ in range(50):
        assert batch.sample(known_logits(2), ["force", "ban"])[0].tolist() == [6, 1]


def test_logit_bias_outside_vocab_is_rejected():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        add(make_batch(), "r", logit_bias={8: 1.0})


def test_min_tokens_blocks_eos_and_stop_tokens_until_reached():
    batch = make_batch()
    add(batch, "r", temperature=0.0, min_tokens=2, stop_token_ids=[3])
    add(batch, "ignore", temperature=0.0, min_tokens=2, ignore_eos=True)
    add(batch, "resumed", outputs=[0, 0], temperature=0.0, min_tokens=2)
    # eos (7) is the most likely token, stop token 3 the second.
    logits = [0.0, 1.0, 2.0, 5.0, 0.0, 0.0, 0.0, 9.0]
    ids = ["r", "ignore", "resumed"]
    for step in range(3):
        tokens = batch.sample(torch.tensor([logits] * 3), ids)[0].tolist()
        assert tokens == ([2, EOS, EOS] if step < 2 else [EOS, EOS, EOS])
        batch.append_tokens(ids, tokens)


def test_same_seed_gives_same_tokens_whatever_the_batch():
    vocab = 64
    steps = 50
    step_logits = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(6))

    def run(batch: SamplingBatch, others: list[str], seed: int) -> list[int]:
        add(batch, "seeded", temperature=1.2, top_p=0.95, seed=seed)
        ids = [*others[:1], "seeded", *others[1:]]
        out = []
        for step in range(steps):
            logits = torch.randn(len(ids), vocab)
            logits[ids.index("seeded")] = step_logits[step]
            tokens = batch.sample(logits, ids)[0].tolist()
            batch.append_tokens(ids, tokens)
            out.append(tokens[ids.index("seeded")])
        return out

    alone = run(make_batch(vocab), [], seed=1234)
    crowded = make_batch(vocab)
    for name, params in [("a", {}), ("b", {"temperature": 0.0}), ("c", {"seed": 99, "top_k": 5})]:
        add(crowded, name, **params)
    torch.manual_seed(7)
    in_batch_1 = run(crowded, ["a", "b", "c"], seed=1234)
    other = make_batch(vocab)
    add(other, "x", seed=1235)
    torch.manual_seed(8)
    in_batch_2 = run(other, ["x"], seed=1234)
    assert alone == in_batch_1 == in_batch_2
    assert run(make_batch(vocab), [], seed=1235) != alone


def test_resumed_seeded_request_continues_its_sequence():
    vocab = 64
    logits = torch.randn(20, vocab, generator=torch.Generator().manual_seed(9))
    batch = make_batch(vocab)
    add(batch, "r", seed=5)
    uninterrupted = []
    for step in range(20):
        token = batch.sample(logits[step : step + 1].clone(), ["r"])[0].tolist()
        batch.append_tokens(["r"], token)
        uninterrupted += token
    batch.remove("r")
    resumed = make_batch(vocab)
    add(resumed, "r", outputs=uninterrupted[:12], seed=5)
    rest = []
    for step in range(12, 20):
        token = resumed.sample(logits[step : step + 1].clone(), ["r"])[0].tolist()
        resumed.append_tokens(["r"], token)
        rest += token
    assert rest == uninterrupted[12:]


def test_logprobs_are_raw_log_softmax_with_chosen_token_first():
    torch.manual_seed(10)
    vocab = 50
    batch = make_batch(vocab)
    add(batch, "few", temperature=0.7, repetition_penalty=1.5, logprobs=2, logit_bias={3: 5.0})
    add(batch, "none", temperature=0.0)
    add(batch, "many", temperature=0.0, logprobs=4)
    logits = torch.randn(3, vocab)
    raw = torch.log_softmax(logits, dim=-1)
    tokens, logprobs = batch.sample(logits.clone(), ["few", "none", "many"])
    assert logprobs is not None
    assert logprobs.token_ids.shape == (3, 5)  # chosen + the largest k asked for (4)
    top_values, top_ids = raw.topk(4, dim=-1)
    assert logprobs.token_ids[:, 0].tolist() == tokens.tolist()
    assert logprobs.token_ids[:, 1:].tolist() == top_ids.tolist()
    assert torch.equal(logprobs.logprobs[:, 1:], top_values)
    assert torch.equal(logprobs.logprobs[:, 0], raw.gather(1, tokens[:, None])[:, 0])
    expected_ranks = [int((raw[i] > raw[i, tokens[i]]).sum()) + 1 for i in range(3)]
    assert logprobs.ranks.tolist() == expected_ranks
    assert logprobs.ranks[1:].tolist() == [1, 1]  # greedy rows: the raw argmax


def test_prompt_logprobs():
    batch = make_batch(vocab=8)
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(11))
    targets = torch.tensor([5, 0, 2])
    result = batch.compute_prompt_logprobs(logits, targets, 2)
    raw = torch.log_softmax(logits, dim=-1)
    assert result.token_ids[:, 0].tolist() == [5, 0, 2]
    assert torch.equal(result.logprobs[:, 0], raw[torch.arange(3), targets])
    assert result.token_ids[:, 1:].tolist() == raw.topk(2, dim=-1).indices.tolist()
    assert result.ranks.tolist() == [
        int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate([5, 0, 2])
    ]


def test_rows_in_any_order_and_after_removal():
    batch = make_batch()
    add(batch, "a", temperature=0.0, logit_bias={4: 100.0})
    add(batch, "b", temperature=0.0)
    add(batch, "c", temperature=0.0, logit_bias={5: 100.0})
    assert len(batch) == 3 and "b" in batch
    assert batch.sample(known_logits(3), ["c", "a", "b"])[0].tolist() == [5, 4, 0]
    batch.remove("a")
    assert "a" not in batch and len(batch) == 2
    add(batch, "d", temperature=0.0)  # reuses a's row: no bias left behind
    assert batch.sample(known_logits(3), ["d", "c", "b"])[0].tolist() == [0, 5, 0]
    assert batch.sample(known_logits(1), ["c"])[0].tolist() == [5]


def test_all_greedy_batch_returns_argmax_and_no_logprobs():
    batch = make_batch(vocab=100)
    for i in range(4):
        add(batch, f"r{i}", temperature=0.0)
    logits = torch.randn(4, 100)
    tokens, logprobs = batch.sample(logits.clone(), [f"r{i}" for i in range(4)])
    assert tokens.tolist() == logits.argmax(-1).tolist() and logprobs is None


def reference_kept(logits: torch.Tensor, top_k: int | None, top_p: float) -> set[int]:
    """Full-sort top-k then top-p: the smallest most-likely set reaching top_p of the top-k mass."""
    probs = logits.softmax(-1)
    values, order = probs.sort(descending=True)
    if top_k is not None:
        values, order = values[:top_k], order[:top_k]
    cumulative = values.cumsum(0) / values.sum()
    num = int((cumulative < top_p).sum()) + 1
    return set(order[:num].tolist())


def test_top_p_far_into_a_flat_distribution_matches_a_full_sort():
    vocab = 5000
    gen = torch.Generator().manual_seed(12)
    cases = [
        (None, 0.5, 0.3),
        (None, 0.9, 4.0),
        (100, 0.9, 0.5),
        (2000, 0.95, 0.1),
        (None, 0.3, 1.0),
    ]
    batch = make_batch(vocab)
    logits = torch.stack([torch.randn(vocab, generator=gen) * scale for _, _, scale in cases])
    for i, (k, p, _) in enumerate(cases):
        add(batch, f"r{i}", top_k=k, top_p=p)
    probs = batch.probs(logits.clone(), [f"r{i}" for i in range(len(cases))])
    for i, (k, p, _) in enumerate(cases):
        expected = reference_kept(logits[i], k, p)
        assert set(torch.nonzero(probs[i]).flatten().tolist()) == expected
    # The flat rows need more candidates than the first rounds examine.
    assert len(reference_kept(logits[0], None, 0.5)) > 1024


def test_penalties_leave_min_tokens_mask_intact_and_track_appended_tokens():
    batch = make_batch()
    add(batch, "r", prompt=[EOS, 1], temperature=0.0, min_tokens=1, repetition_penalty=2.0)
    logits = [0.0, 4.0, 3.0, 0.0, 0.0, 0.0, 0.0, 9.0]
    probs = batch.probs(torch.tensor([logits]), ["r"])
    assert not probs.isnan().any() and probs[0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]  # 4 / 2 < 3
    batch.append_tokens(["r"], [2])
    # eos allowed now but penalized (9 / 2 = 4.5); token 2 now penalized too (3 / 2).
    assert batch.sample(torch.tensor([logits]), ["r"])[0].tolist() == [EOS]
    add(batch, "s", prompt=[0], frequency_penalty=1.0)
    batch.append_tokens(["s"], [4])
    batch.append_tokens(["s"], [4])
    got = processed_logits(batch, [0.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0, 1.0], "s")
    assert got == pytest.approx([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], abs=1e-5)


def test_draws_follow_the_distribution_across_cdf_blocks():
    # Mass on tokens in different 1024-token blocks, including both sides of a block edge
    # and the partial last block.
    vocab = 3000
    where = [5, 1000, 1023, 1024, 2100, 2999]
    probs = [0.1, 0.2, 0.05, 0.25, 0.3, 0.1]
    logits = torch.full((vocab,), float("-inf"))
    logits[where] = torch.tensor(probs).log()
    torch.manual_seed(13)
    batch = make_batch(vocab, rows=100)
    ids = [f"r{i}" for i in range(100)]
    for r in ids:
        add(batch, r)
    counts = torch.zeros(vocab, dtype=torch.int64)
    for _ in range(50):
        tokens, _ = batch.sample(logits.expand(100, vocab).clone(), ids)
        counts += torch.bincount(tokens, minlength=vocab)
    assert set(torch.nonzero(counts).flatten().tolist()) == set(where)
    assert (counts[where].double() / counts.sum()).tolist() == pytest.approx(probs, abs=0.02)
