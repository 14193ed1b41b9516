from __future__ import annotations

import pytest

from tokenmill.engine.spec_decode.policy import PRIOR_ALPHA, SpecDecodePolicy, StepCost


def test_step_cost_is_monotone_in_tokens() -> None:
    cost = StepCost([(1, 0.020), (2, 0.025), (4, 0.021), (8, 0.030)])
    assert cost.seconds == [0.020, 0.025, 0.025, 0.030]
    cost.observe(1, 0.040)  # a slow 1-token step pulls the 1-token point up, and its successors
    assert cost.seconds[0] == pytest.approx(0.022)
    assert cost.seconds[1:] == [0.025, 0.025, 0.030]


def test_step_cost_interpolates_and_extrapolates() -> None:
    cost = StepCost([(1, 0.020), (4, 0.026), (16, 0.050)])
    assert cost(1) == 0.020
    assert cost(2) == pytest.approx(0.022)
    assert cost(10) == pytest.approx(0.038)
    assert cost(28) == pytest.approx(0.074)  # along the last segment
    assert cost(0) == 0.020


# A memory-bound forward at small batches (1-8 tokens cost about the same), then linear.
COST = StepCost([(1, 0.020), (8, 0.022), (16, 0.030), (64, 0.090), (320, 0.410)])


def test_a_lone_request_speculates_all_it_has() -> None:
    policy = SpecDecodePolicy(4, COST)
    assert policy.plan({"a": 4}, num_step_tokens=1, num_sampling=1) == {"a": 4}
    assert policy.plan({"a": 2}, num_step_tokens=1, num_sampling=1) == {"a": 2}
    assert policy.plan({"a": 0}, num_step_tokens=1, num_sampling=1) == {}


def test_a_large_batch_switches_speculation_off() -> None:
    policy = SpecDecodePolicy(4, COST)
    drafts = {f"r{i}": 4 for i in range(64)}
    # 64 decodes: each draft adds ~1.25 ms for alpha^i < 0.6 tokens of 64 / 90 ms each.
    assert policy.plan(drafts, num_step_tokens=64, num_sampling=64) == {}


def test_acceptance_steers_each_request() -> None:
    policy = SpecDecodePolicy(4, COST)
    for _ in range(6):
        policy.step(["good", "bad"])
        policy.record("good", 4, 4)
        policy.record("bad", 4, 0)
    assert policy.alpha("good") > 0.85 and policy.alpha("bad") < 0.2
    plan = policy.plan({"good": 4, "bad": 4, **{f"r{i}": 0 for i in range(6)}}, 8, 8)
    assert plan == {"good": 4}
    # Observations fade: without new ones the estimate returns to the proposer's rate over
    # all requests, which is also a new request's.
    for _ in range(60):
        policy.step(["bad"])
    assert policy.alpha("bad") == pytest.approx(policy.alpha("new"), abs=0.01)
    assert 0.4 < policy.alpha("new") < 0.6


def test_a_poor_proposer_lowers_every_new_requests_hope() -> None:
    """A draft model that costs a quarter of the target: worth it for a new request at the
    prior, not once 30 requests saw every draft rejected."""
    policy = SpecDecodePolicy(4, COST, draft_cost=StepCost([(1, 0.005), (8, 0.006)]))
    assert policy.alpha("new") == PRIOR_ALPHA
    assert policy.plan({"new": 4}, 1, 1) == {"new": 2}
    for i in range(30):
        policy.record(f"r{i}", 4, 0)
    assert policy.alpha("new") < 0.1
    assert policy.plan({"new": 4}, 1, 1) == {}


def test_record_counts_each_position_up_to_the_first_rejection() -> None:
    policy = SpecDecodePolicy(4, COST)
    policy.record("a", 4, 1)  # the 1st accepted, the 2nd rejected, the rest never tried
    # The proposer's rates (a's prior) saw the same: 1/1, 0/1, untried, untried.
    g = [(1 + PRIOR_ALPHA * 2) / 3, (0 + PRIOR_ALPHA * 2) / 3, PRIOR_ALPHA, PRIOR_ALPHA]
    assert [policy.alpha("new", i) for i in range(4)] == pytest.approx(g)
    assert [policy.alpha("a", i) for i in range(4)] == pytest.approx(
        [(1 + 2 * g[0]) / 3, (0 + 2 * g[1]) / 3, PRIOR_ALPHA, PRIOR_ALPHA]
    )


def test_correlated_acceptance_values_deep_drafts() -> None:
    """Copying: the first draft is a coin flip, but once it is accepted so are the rest;
    the 4th draft is then worth ~0.35 tokens (alpha^4 would say 0.06)."""
    policy = SpecDecodePolicy(4, COST)
    for i in range(20):
        policy.step(["c"])
        policy.record("c", 4, 4 if i % 2 else 0)
    values = policy.draft_values("c", 4)
    assert values[0] == pytest.approx(0.5, abs=0.05)
    assert values[3] > 0.3  # alpha^4 with alpha = 0.5 would give 0.06


def test_without_adaptivity_every_draft_is_verified() -> None:
    policy = SpecDecodePolicy(3, COST, adaptive=False)
    drafts = {f"r{i}": 5 for i in range(64)}
    assert policy.plan(drafts, 64, 64) == {f"r{i}": 3 for i in range(64)}


def test_a_draft_models_cost_counts_against_speculating() -> None:
    free = SpecDecodePolicy(4, COST)
    costly = SpecDecodePolicy(4, COST, draft_cost=StepCost([(1, 0.030), (8, 0.032)]))
    assert free.plan({"a": 4}, 1, 1) == {"a": 4}
    assert costly.plan({"a": 4}, 1, 1) == {}
