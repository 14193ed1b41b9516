"""How many tokens each request speculates: per-request acceptance against the step's cost.

Each request keeps a running estimate of how likely its i-th draft is accepted once the
first i - 1 were: alpha_i = successes_i / trials_i per draft position, both decayed every
step so the estimate follows the text (a request starts copying a paragraph, then stops),
and shrunk towards the proposer's acceptance over all recent requests (itself starting
from a fixed prior), which is also where a new request starts: a proposer that does
poorly on this traffic is not re-tried at full hope by every new request. Acceptance is
strongly correlated along a draft (a copied span is either in step with the source or
not), so the per-position rates matter: when copying, alpha_1 may be 0.8 while
alpha_2..k are near 1. The i-th draft of a request is worth alpha_1 * ... * alpha_i
expected tokens.

A step that decodes R requests over T tokens takes cost(T) (the target's forward time at T
tokens, measured on this machine at start-up, interpolated). Speculating K more tokens
(each with its proposer's own cost: a draft model's forward at the batch's size,
amortized per request; zero for n-gram) yields the
expected tokens G of those drafts, so the step's rate is

    (R + G) / (cost(T + K) + K * draft_cost(R) / R)

`plan` adds drafts in order of value (best first) and keeps the prefix with the
best rate. Small batches, where a forward costs about the same at 1 and at 5 tokens per
request, speculate even at modest acceptance; large compute-bound batches switch
speculation off unless acceptance is near 1 — the crossover falls out of the measured
costs rather than a fixed batch-size threshold. With `adaptive=False` every request
speculates every draft it has.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

# Prior acceptance, and its weight in trials: a new request is tried at once.
PRIOR_ALPHA = 0.6
PRIOR_WEIGHT = 2.0
# Per-step decay of a request's observed counts (memory of ~10 steps).
DECAY = 0.9
# Decay of the proposer's acceptance over all requests, per verification (memory of ~200).
GLOBAL_DECAY = 0.995


class _Acceptance:
    """Decayed successes and trials per draft position, shrunk towards a prior."""

    def __init__(self, num_positions: int, prior: _Acceptance | float) -> None:
        self.successes = [0.0] * num_positions
        self.trials = [0.0] * num_positions
        self.prior = prior

    def alpha(self, position: int) -> float:
        prior = self.prior if isinstance(self.prior, float) else self.prior.alpha(position)
        return (self.successes[position] + prior * PRIOR_WEIGHT) / (self.trials[position] + PRIOR_WEIGHT)

    def values(self, num_drafts: int) -> list[float]:
        """Expected accepted tokens contributed by each of the first drafts."""
        out, value = [], 1.0
        for i in range(num_drafts):
            value *= self.alpha(i)
            out.append(value)
        return out

    def record(self, num_proposed: int, num_accepted: int) -> None:
        # Positions up to the first rejection were tried; all before it succeeded.
        for position in range(min(num_accepted + 1, num_proposed, len(self.trials))):
            self.trials[position] += 1
            if position < num_accepted:
                self.successes[position] += 1

    def decay(self, factor: float) -> None:
        self.successes = [x * factor for x in self.successes]
        self.trials = [x * factor for x in self.trials]


class StepCost:
    """Seconds per forward as a function of the step's token count, piecewise linear
    through measured points (extrapolated along the last segment).

    The points are measured once at start-up, then follow the live steps: `observe`
    moves the point nearest an executed step's size towards its measured time (scaled
    along the curve), so a start-up measurement disturbed by other load, or a machine
    whose speed changes, is corrected within a few dozen steps."""

    # Weight of one observation.
    RATE = 0.1

    def __init__(self, points: Sequence[tuple[int, float]]) -> None:
        points = sorted(points)
        assert points and all(t > 0 and s > 0 for t, s in points), points
        self.tokens = [t for t, _ in points]
        self.seconds = [s for _, s in points]
        self._monotone()

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or not seconds > 0:
            return
        i = min(range(len(self.tokens)), key=lambda j: abs(math.log(self.tokens[j] / num_tokens)))
        scaled = seconds * self.seconds[i] / self(num_tokens)
        self.seconds[i] += self.RATE * (scaled - self.seconds[i])
        self._monotone()

    def _monotone(self) -> None:
        """A forward over more tokens never costs less: a noisy point below an earlier
        one is raised to it."""
        for i in range(1, len(self.seconds)):
            self.seconds[i] = max(self.seconds[i], self.seconds[i - 1])

    def __call__(self, num_tokens: int) -> float:
        ts, ss = self.tokens, self.seconds
        if len(ts) == 1:
            return ss[0] * max(num_tokens, 1) / ts[0] if num_tokens > ts[0] else ss[0]
        i = bisect.bisect_left(ts, num_tokens)
        if i < len(ts) and ts[i] == num_tokens:
            return ss[i]
        if i == 0:
            return ss[0]
        i = min(i, len(ts) - 1)
        t0, t1, s0, s1 = ts[i - 1], ts[i], ss[i - 1], ss[i]
        return max(s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0), 1e-9)


class SpecDecodePolicy:
    def __init__(
        self,
        max_tokens: int,
        cost: StepCost | None = None,
        draft_cost: StepCost | None = None,
        adaptive: bool = True,
        prior_alpha: float = PRIOR_ALPHA,
    ) -> None:
        """`prior_alpha`: the acceptance assumed of a proposer nothing is known about yet."""
        self.max_tokens = max_tokens
        self.cost = cost
        self.draft_cost = draft_cost
        self.adaptive = adaptive and cost is not None
        # The proposer's acceptance over all recent requests: a new request's prior, and
        # the level a request's own estimate returns to.
        self._global = _Acceptance(max_tokens, prior_alpha)
        self._acceptance: dict[str, _Acceptance] = {}

    def alpha(self, req_id: str, position: int = 0) -> float:
        """The estimated acceptance of a request's draft at `position` (0: the first)."""
        state = self._acceptance.get(req_id)
        return (self._global if state is None else state).alpha(position)

    def draft_values(self, req_id: str, num_drafts: int) -> list[float]:
        """Expected accepted tokens of a request's first drafts, each (the i-th: the
        product of its positions' acceptance up to i)."""
        state = self._acceptance.get(req_id)
        return (self._global if state is None else state).values(num_drafts)

    def plan(self, available: dict[str, int], num_step_tokens: int, num_sampling: int) -> dict[str, int]:
        """Drafts to verify per request: `available` (req_id -> drafts it could verify),
        the step's tokens without speculation and how many requests sample this step."""
        if not self.adaptive:
            return {r: min(n, self.max_tokens) for r, n in available.items() if n > 0}
        assert self.cost is not None
        candidates = sorted(
            (
                (value, i, r)
                for r, n in available.items()
                for i, value in enumerate(self.draft_values(r, min(n, self.max_tokens)), start=1)
            ),
            key=lambda c: (-c[0], c[1]),
        )
        base = self.cost(num_step_tokens)
        # A draft model's forward per proposing request, amortized over the batch.
        per_draft = self.draft_cost(num_sampling) / num_sampling if self.draft_cost is not None else 0.0
        best_rate, best_len = num_sampling / base, 0
        gain = 0.0
        for k, (value, _, _) in enumerate(candidates, start=1):
            gain += value
            rate = (num_sampling + gain) / (self.cost(num_step_tokens + k) + k * per_draft)
            if rate > best_rate:
                best_rate, best_len = rate, k
        chosen: dict[str, int] = {}
        for _, _, r in candidates[:best_len]:
            chosen[r] = chosen.get(r, 0) + 1
        return chosen

    def observe(self, num_tokens: int, seconds: float, draft_rows: Sequence[tuple[int, float]] = ()) -> None:
        """An executed step: its target forward over num_tokens, and the draft model's
        forwards (rows, seconds)."""
        if self.cost is not None:
            self.cost.observe(num_tokens, seconds)
        if self.draft_cost is not None:
            for rows, s in draft_rows:
                self.draft_cost.observe(rows, s)

    def step(self, req_ids: Sequence[str]) -> None:
        """Age every running request's observations by one step."""
        for r in req_ids:
            state = self._acceptance.get(r)
            if state is not None:
                state.decay(DECAY)

    def record(self, req_id: str, num_proposed: int, num_accepted: int) -> None:
        """A verification: the first num_accepted of num_proposed drafts were accepted."""
        assert 0 <= num_accepted <= num_proposed, (num_accepted, num_proposed)
        if num_proposed == 0:
            return
        state = self._acceptance.get(req_id)
        if state is None:
            state = self._acceptance[req_id] = _Acceptance(self.max_tokens, self._global)
        state.record(num_proposed, num_accepted)
        self._global.decay(GLOBAL_DECAY)
        self._global.record(num_proposed, num_accepted)

    def remove(self, req_id: str) -> None:
        self._acceptance.pop(req_id, None)
