"""Scheduler: budgets, chunked prefill, priorities, preemption, stops, logprobs, a fuzz run.

A fake runner stands in for the model: it keeps each request's tokens and block table from
the SchedulerOutput diffs alone, writes every computed token id into a fake paged KV store
(the whole batch first, as the real runner writes a layer's K/V before attention), reads a
request's whole context back through its block table, and samples a token that is a
deterministic function of what it read. Wrong blocks, wrong prefix hits or a wrong resume
change the tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from tokenmill.engine.config import CacheConfig, SchedulerConfig
from tokenmill.engine.outputs import EngineCoreOutput, Logprob
from tokenmill.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from tokenmill.engine.runner.output import LogprobsTensors, ModelRunnerOutput
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.scheduler_output import SchedulerOutput

BLOCK = 4
VOCAB = 50
EOS = 0


def next_token(context: list[int]) -> int:
    acc = 0
    for i, token in enumerate(context):
        acc = (acc * 31 + token * (i + 7)) % 1_000_003
    return acc % VOCAB


@dataclass
class _RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    def __init__(self, num_blocks: int, *, forced: dict[str, list[int]] | None = None) -> None:
        self.kv: list[list[int | None]] = [[None] * BLOCK for _ in range(num_blocks)]
        self.reqs: dict[str, _RunnerState] = {}
        # req_id -> tokens to sample instead of next_token (first ones first).
        self.forced = forced or {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        for new in out.new_reqs:
            assert new.req_id not in self.reqs
            self.reqs[new.req_id] = _RunnerState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in out.cached_reqs:
            state = self.reqs[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids += cached.new_block_ids
        scheduled = {n.req_id for n in out.new_reqs} | {c.req_id for c in out.cached_reqs}
        assert scheduled == set(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        for req_id, num in out.num_scheduled_tokens.items():  # write phase
            state = self.reqs[req_id]
            end = state.num_computed_tokens + num
            assert num > 0 and end <= len(state.token_ids)
            assert len(state.block_ids) * BLOCK >= end
            for pos in range(state.num_computed_tokens, end):
                self.kv[state.block_ids[pos // BLOCK]][pos % BLOCK] = state.token_ids[pos]
        result = ModelRunnerOutput()
        for req_id, num in out.num_scheduled_tokens.items():  # read + sample phase
            state = self.reqs[req_id]
            state.num_computed_tokens += num
            if state.num_computed_tokens < len(state.token_ids):
                continue  # mid chunked prefill
            context = [
                self.kv[state.block_ids[p // BLOCK]][p % BLOCK]
                for p in range(state.num_computed_tokens)
            ]
            assert context == state.token_ids, f"{req_id} read wrong K/V"
            forced = self.forced.get(req_id)
            token = forced.pop(0) if forced else next_token(state.token_ids)
            state.token_ids.append(token)
            result.req_ids.append(req_id)
            result.sampled_token_ids.append([token])
        return result


def make_scheduler(
    num_blocks: int = 64,
    *,
    max_num_seqs: int = 16,
    budget: int = 64,
    max_model_len: int = 64,
    prefix_caching: bool = True,
    chunked: bool = True,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        num_blocks,
    )


def make_request(
    req_id: str,
    prompt: list[int] | int,
    *,
    priority: int = 0,
    arrival: float = 0.0,
    salt: str | None = None,
    **params: object,
) -> Request:
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else prompt
    params.setdefault("max_tokens", 8)
    return Request(
        req_id,
        tokens,
        SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
        priority=priority,
        cache_salt=salt,
        arrival_time=arrival,
    )


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    return out, sched.update(out, runner.execute(out))


def expected_tokens(request: Request, max_model_len: int) -> tuple[list[int], FinishReason]:
    """What greedy next_token decoding must produce, stop rules applied."""
    params = request.sampling_params
    tokens = list(request.prompt_token_ids)
    out: list[int] = []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        is_stop = (token == EOS and not params.ignore_eos) or token in params.stop_token_ids
        if is_stop and len(out) > params.min_tokens:
            return out, FinishReason.STOP
        if (params.max_tokens is not None and len(out) >= params.max_tokens) or len(
            tokens
        ) >= max_model_len:
            return out, FinishReason.LENGTH


def assert_all_blocks_free(sched: Scheduler) -> None:
    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert [b.ref_cnt for b in pool.blocks] == [0] * pool.num_blocks


# ---------------------------------------------------------------------- add_request checks


def test_add_request_rejects_what_can_never_be_served() -> None:
    sched = make_scheduler(num_blocks=4, max_model_len=32)  # 16 token slots
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("empty", []))
    with pytest.raises(ValueError, match="max_model_len=32"):
        sched.add_request(make_request("long", 30, max_tokens=3))
    with pytest.raises(ValueError, match="no room"):
        sched.add_request(make_request("none", 32, max_tokens=None))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("big", 10, max_tokens=8))  # 17 slots needed
    with pytest.raises(ValueError, match="n=2"):
        sched.add_request(make_request("n", 4, n=2))
    # 10 + 7 tokens: the 17th is sampled, never computed: 16 slots suffice.
    sched.add_request(make_request("fits", 10, max_tokens=7))
    with pytest.raises(ValueError, match="already exists"):
        sched.add_request(make_request("fits", 3))
    assert sched.num_unfinished_requests == 1


# ------------------------------------------------------------------------- basic flow


def test_prefill_then_decode_then_length_stop() -> None:
    sched = make_scheduler()
    runner = FakeRunner(64)
    request = make_request("a", 6, max_tokens=3)
    sched.add_request(request)
    out, outputs = step(sched, runner)
    (new,) = out.new_reqs
    assert (new.token_ids, new.block_ids, new.num_computed_tokens) == (
        [1, 2, 3, 4, 5, 6],
        [0, 1],
        0,
    )
    assert out.num_scheduled_tokens == {"a": 6}
    first = next_token([1, 2, 3, 4, 5, 6])
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("a", [first], None)]
    assert request.first_scheduled_time is not None and request.first_token_time is not None

    out, outputs = step(sched, runner)
    assert out.new_reqs == []
    (cached,) = out.cached_reqs
    assert (cached.req_id, cached.new_block_ids, cached.num_computed_tokens) == ("a", [], 6)
    assert out.num_scheduled_tokens == {"a": 1}

    out, outputs = step(sched, runner)
    assert out.cached_reqs[0].new_block_ids == []
    (last,) = outputs
    assert last.finish_reason == FinishReason.LENGTH
    assert request.output_token_ids == expected_tokens(make_request("a", 6, max_tokens=3), 64)[0]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.kv_cache.num_free_blocks == 64  # freed at once
    assert not sched.has_unfinished_requests()
    assert sched.has_finished_requests()
    out = sched.schedule()
    assert out.finished_req_ids == {"a"}
    assert out.is_empty
    assert not sched.has_finished_requests()


def test_chunked_prefill_splits_the_prompt_under_the_budget() -> None:
    sched = make_scheduler(budget=8)
    runner = FakeRunner(64)
    sched.add_request(make_request("a", 20, max_tokens=2))
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.new_reqs[0].block_ids == [0, 1]
    assert outputs == []  # nothing sampled mid-prefill
    out, outputs = step(sched, runner)
    assert (out.cached_reqs[0].new_block_ids, out.cached_reqs[0].num_computed_tokens) == ([2, 3], 8)
    assert out.num_scheduled_tokens == {"a": 8}
    assert outputs == []
    out, outputs = step(sched, runner)
    assert (out.cached_reqs[0].new_block_ids, out.num_scheduled_tokens) == ([4], {"a": 4})
    assert outputs[0].new_token_ids == [next_token(list(range(1, 21)))]


def test_running_decodes_come_first_and_the_prefill_takes_the_rest() -> None:
    sched = make_scheduler(budget=10)
    runner = FakeRunner(64)
    sched.add_request(make_request("a", 6, max_tokens=5))
    step(sched, runner)
    sched.add_request(make_request("b", list(range(20, 35)), max_tokens=5))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 6}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make_scheduler(budget=16, max_model_len=16, chunked=False)
    runner = FakeRunner(64)
    sched.add_request(make_request("a", 6, max_tokens=5))
    sched.add_request(make_request("b", list(range(20, 32)), max_tokens=4))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 6}  # b (12) does not fit the 10 left
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 12}


def test_max_num_seqs() -> None:
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=2, ignore_eos=True))
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}  # both finish here
    out, _ = step(sched, runner)
    assert set(out.num_scheduled_tokens) == {"r2"}
    assert out.finished_req_ids == {"r0", "r1"}


def test_waiting_order_is_priority_then_arrival_then_insertion() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(64)
    specs = [
        ("late-p0", 0, 2.0),
        ("p1", 1, 0.0),
        ("early-p0", 0, 1.0),
        ("tie-a", 2, 5.0),
        ("tie-b", 2, 5.0),
    ]
    for req_id, priority, arrival in specs:
        sched.add_request(make_request(req_id, 3, max_tokens=1, priority=priority, arrival=arrival))
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        order += list(out.num_scheduled_tokens)
    assert order == ["early-p0", "late-p0", "p1", "tie-a", "tie-b"]


# ----------------------------------------------------------------------------- preemption


def test_preemption_victim_is_the_latest_arrival_of_equal_priority() -> None:
    # 6 blocks; two requests of 8 prompt tokens (2 blocks each) grow until blocks run out.
    sched = make_scheduler(num_blocks=6, prefix_caching=False)
    runner = FakeRunner(6)
    a = make_request("a", list(range(1, 9)), max_tokens=12, arrival=1.0, ignore_eos=True)
    b = make_request("b", list(range(11, 19)), max_tokens=12, arrival=2.0, ignore_eos=True)
    sched.add_request(b)
    sched.add_request(a)
    preempted_step = None
    for i in range(12):
        out, _ = step(sched, runner)
        if out.finished_req_ids:
            preempted_step = i
            break
    assert preempted_step is not None
    assert out.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.num_preemptions) == (0, 1)
    assert sched.make_stats().num_preemptions == 1
    assert sched.make_stats().num_waiting_reqs == 1
    assert set(out.num_scheduled_tokens) == {"a"}
    generated = list(b.output_token_ids)
    assert generated  # it had decoded before being preempted
    # Once a finishes, b resumes whole: prompt + what it had generated.
    while True:
        out, _ = step(sched, runner)
        if out.new_reqs:
            break
    (resumed,) = out.new_reqs
    assert resumed.req_id == "b"
    assert resumed.token_ids == list(range(11, 19)) + generated
    assert resumed.num_prompt_tokens == 8
    assert resumed.num_computed_tokens == 0
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert (
        b.output_token_ids
        == expected_tokens(
            make_request("b", list(range(11, 19)), max_tokens=12, ignore_eos=True), 64
        )[0]
    )
    assert (
        a.output_token_ids
        == expected_tokens(
            make_request("a", list(range(1, 9)), max_tokens=12, ignore_eos=True), 64
        )[0]
    )
    assert_all_blocks_free(sched)


def test_preemption_victim_is_the_worst_priority_even_if_earlier() -> None:
    sched = make_scheduler(num_blocks=6, prefix_caching=False)
    runner = FakeRunner(6)
    a = make_request("a", 8, max_tokens=12, arrival=1.0, priority=5, ignore_eos=True)
    b = make_request("b", list(range(11, 19)), max_tokens=12, arrival=2.0, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(12):
        out, _ = step(sched, runner)
        if out.finished_req_ids:
            break
    assert out.finished_req_ids == {"a"}
    assert a.status == RequestStatus.PREEMPTED


def test_resumed_request_reuses_its_cached_blocks() -> None:
    sched = make_scheduler(num_blocks=6)
    runner = FakeRunner(6)
    a = make_request("a", list(range(1, 9)), max_tokens=12, arrival=1.0, ignore_eos=True)
    b = make_request("b", list(range(21, 29)), max_tokens=12, arrival=2.0, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    while b.status != RequestStatus.PREEMPTED:
        step(sched, runner)
    # b's blocks stay cached while free; it resumes as soon as one block frees up...
    while True:
        out, _ = step(sched, runner)
        if out.new_reqs:
            break
    (resumed,) = out.new_reqs
    assert resumed.num_computed_tokens > 0
    assert resumed.num_computed_tokens % BLOCK == 0
    assert out.num_scheduled_tokens["b"] == len(resumed.token_ids) - resumed.num_computed_tokens
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert (
        b.output_token_ids
        == expected_tokens(
            make_request("b", list(range(21, 29)), max_tokens=12, ignore_eos=True), 64
        )[0]
    )
    assert_all_blocks_free(sched)


def test_better_priority_waiting_request_preempts_a_worse_running_one() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(64)
    low = make_request("low", 4, max_tokens=10, priority=1, ignore_eos=True)
    sched.add_request(low)
    step(sched, runner)
    same = make_request("same", 4, max_tokens=2, priority=1, arrival=-1.0)
    sched.add_request(same)
    out, _ = step(sched, runner)
    assert out.finished_req_ids == set() and set(out.num_scheduled_tokens) == {"low"}
    high = make_request("high", 4, max_tokens=2, priority=0, arrival=5.0)
    sched.add_request(high)
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"low"}
    assert [n.req_id for n in out.new_reqs] == ["high"]
    assert low.status == RequestStatus.PREEMPTED
    # Back in the queue by (priority, arrival): "same" arrived earlier.
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        order += [n.req_id for n in out.new_reqs]
    assert order == ["same", "low"]


def test_better_priority_request_preempts_for_blocks() -> None:
    sched = make_scheduler(num_blocks=4)
    runner = FakeRunner(4)
    low = make_request("low", 9, max_tokens=6, priority=1, ignore_eos=True)  # 3 blocks soon 4
    sched.add_request(low)
    step(sched, runner)
    high = make_request("high", list(range(30, 35)), max_tokens=2, priority=0)
    sched.add_request(high)
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"low"}
    assert [n.req_id for n in out.new_reqs] == ["high"]


# ------------------------------------------------------------------------ abort and finish


def test_abort_frees_blocks_at_once_wherever_the_request_is() -> None:
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    runner = FakeRunner(8)
    running = make_request("running", 9)
    waiting = make_request("waiting", 5)
    sched.add_request(running)
    sched.add_request(waiting)
    out = sched.schedule()
    assert sched.kv_cache.num_free_blocks == 5
    sched.abort_requests(["running", "waiting", "unknown"])
    assert sched.kv_cache.num_free_blocks == 8
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()
    # The step that was in flight is ignored for the aborted request.
    assert sched.update(out, runner.execute(out)) == []
    assert sched.schedule().finished_req_ids == {"running", "waiting"}
    assert_all_blocks_free(sched)


def test_finish_requests_for_stop_strings() -> None:
    sched = make_scheduler()
    runner = FakeRunner(64)
    request = make_request("a", 5)
    sched.add_request(request)
    step(sched, runner)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert request.finish_reason == FinishReason.STOP
    assert sched.kv_cache.num_free_blocks == 64
    with pytest.raises(ValueError, match="not a finished status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


# -------------------------------------------------------------------------------- stops


def _run_forced(
    request: Request, tokens: list[int], max_model_len: int = 64
) -> list[EngineCoreOutput]:
    sched = make_scheduler(max_model_len=max_model_len)
    runner = FakeRunner(64, forced={request.request_id: list(tokens)})
    sched.add_request(request)
    outputs: list[EngineCoreOutput] = []
    while sched.has_unfinished_requests():
        outputs += step(sched, runner)[1]
    return outputs


def test_eos_stops_unless_ignored() -> None:
    outputs = _run_forced(make_request("a", 3), [5, EOS, 7])
    assert [o.new_token_ids for o in outputs] == [[5], [EOS]]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (FinishReason.STOP, None)
    outputs = _run_forced(make_request("a", 3, max_tokens=3, ignore_eos=True), [5, EOS, 7])
    assert [o.new_token_ids[0] for o in outputs] == [5, EOS, 7]
    assert outputs[-1].finish_reason == FinishReason.LENGTH


def test_stop_token_ids_set_the_stop_reason() -> None:
    outputs = _run_forced(make_request("a", 3, stop_token_ids=[9]), [5, 9, 7])
    assert outputs[-1].new_token_ids == [9]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (FinishReason.STOP, 9)


def test_min_tokens_holds_back_stops() -> None:
    outputs = _run_forced(make_request("a", 3, min_tokens=2, stop_token_ids=[9]), [EOS, 9, 9, 4])
    assert [o.new_token_ids[0] for o in outputs] == [EOS, 9, 9]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (FinishReason.STOP, 9)


def test_max_model_len_caps_a_request_without_max_tokens() -> None:
    request = make_request("a", 10, max_tokens=None, ignore_eos=True)
    outputs = _run_forced(request, [], max_model_len=16)
    assert request.num_tokens == 16
    assert sum(len(o.new_token_ids) for o in outputs) == 6
    assert outputs[-1].finish_reason == FinishReason.LENGTH


# ----------------------------------------------------------------------------- logprobs


def test_sampled_logprobs_become_position_dicts() -> None:
    sched = make_scheduler()
    want = make_request("want", 3, max_tokens=1, logprobs=1)
    plain = make_request("plain", 3, max_tokens=1)
    sched.add_request(want)
    sched.add_request(plain)
    out = sched.schedule()
    runner_output = ModelRunnerOutput(
        req_ids=["want", "plain"],
        sampled_token_ids=[[7], [8]],
        logprobs=LogprobsTensors(
            token_ids=torch.tensor([[7, 3, 7], [8, 8, 1]]),
            logprobs=torch.tensor([[-1.5, -0.5, -1.5], [-0.1, -0.1, -3.0]]),
            ranks=torch.tensor([2, 1]),
        ),
    )
    outputs = {o.req_id: o for o in sched.update(out, runner_output)}
    lp = outputs["want"].new_logprobs
    assert lp == [{7: Logprob(-1.5, 2), 3: Logprob(-0.5, 1)}]
    assert lp is not None and list(lp[0]) == [7, 3]  # chosen token first
    assert outputs["plain"].new_logprobs is None


def test_prompt_logprobs_chunked_none_first_and_no_repeats() -> None:
    sched = make_scheduler(budget=4)
    request = make_request("a", [10, 11, 12, 13, 14, 15], max_tokens=2, prompt_logprobs=0)
    sched.add_request(request)

    def rows(positions: list[int]) -> LogprobsTensors:
        return LogprobsTensors(
            token_ids=torch.tensor([[p + 10] for p in positions]),
            logprobs=torch.tensor([[-float(p)] for p in positions]),
            ranks=torch.tensor([p for p in positions]),
        )

    # Chunk [0, 4): logits at 0..3 score prompt positions 1..4.
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4}
    (o,) = sched.update(out, ModelRunnerOutput(prompt_logprobs={"a": rows([1, 2, 3, 4])}))
    assert o.new_token_ids == []
    assert o.new_prompt_logprobs == [
        None,
        {11: Logprob(-1.0, 1)},
        {12: Logprob(-2.0, 2)},
        {13: Logprob(-3.0, 3)},
        {14: Logprob(-4.0, 4)},
    ]
    # Chunk [4, 6): position 5 is the last prompt token; then the first token is sampled.
    out = sched.schedule()
    (o,) = sched.update(
        out,
        ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[3]], prompt_logprobs={"a": rows([5])}),
    )
    assert o.new_prompt_logprobs == [{15: Logprob(-5.0, 5)}]
    assert o.new_token_ids == [3]
    # A decode: every prompt position was sent already.
    out = sched.schedule()
    (o,) = sched.update(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[4]]))
    assert o.new_prompt_logprobs is None
    assert o.finish_reason == FinishReason.LENGTH


def test_prompt_logprobs_are_not_repeated_after_preemption() -> None:
    sched = make_scheduler(budget=8, max_num_seqs=1)
    request = make_request("a", [10, 11, 12], max_tokens=3, prompt_logprobs=0)
    sched.add_request(request)
    prompt_rows = LogprobsTensors(
        token_ids=torch.tensor([[11], [12]]),
        logprobs=torch.tensor([[-1.0], [-2.0]]),
        ranks=torch.tensor([1, 1]),
    )
    out = sched.schedule()
    (o,) = sched.update(
        out,
        ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[5]], prompt_logprobs={"a": prompt_rows}),
    )
    assert o.new_prompt_logprobs == [None, {11: Logprob(-1.0, 1)}, {12: Logprob(-2.0, 1)}]
    # Force a preemption by a better-priority request that needs the only seat.
    sched.add_request(make_request("vip", 2, max_tokens=1, priority=-1))
    out = sched.schedule()
    assert out.finished_req_ids == {"a"}
    sched.update(out, ModelRunnerOutput(req_ids=["vip"], sampled_token_ids=[[1]]))
    out = sched.schedule()
    assert out.new_reqs[0].token_ids == [10, 11, 12, 5]
    assert out.new_reqs[0].num_computed_tokens == 0  # prompt logprobs skip the cache
    (o,) = sched.update(
        out,
        ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[6]], prompt_logprobs={"a": prompt_rows}),
    )
    assert o.new_prompt_logprobs is None
    assert o.new_token_ids == [6]


# ------------------------------------------------------------------------ prefix sharing


def test_siblings_share_prompt_blocks_in_the_same_step() -> None:
    sched = make_scheduler()
    runner = FakeRunner(64)
    params = SamplingParams(n=2, max_tokens=3, temperature=0.0)
    prompt = list(range(1, 11))
    for i in range(2):
        sched.add_request(Request(f"s{i}", prompt, params.child(i), eos_token_ids=(EOS,)))
    out, outputs = step(sched, runner)
    first, second = out.new_reqs
    assert first.block_ids == [0, 1, 2]
    assert second.block_ids == [0, 1, 3]
    assert (first.num_computed_tokens, second.num_computed_tokens) == (0, 8)
    assert out.num_scheduled_tokens == {"s0": 10, "s1": 2}
    assert [o.num_cached_tokens for o in outputs] == [0, 8]
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)


def test_make_stats() -> None:
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(64)
    sched.add_request(make_request("a", 6, max_tokens=2, ignore_eos=True))
    sched.add_request(make_request("b", 3, max_tokens=2, ignore_eos=True))
    step(sched, runner)
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert (stats.num_kv_blocks_used, stats.num_kv_blocks_total) == (2, 64)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (6, 1)
    assert (stats.num_steps, stats.num_scheduled_tokens) == (1, 6)
    while sched.has_unfinished_requests():
        step(sched, runner)
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_kv_blocks_used) == (0, 0, 0)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (9, 4)
    assert stats.num_steps == 4
    assert stats.prefix_cache_queries == 9


# --------------------------------------------------------------------------------- fuzz


@pytest.mark.parametrize(
    ("seed", "prefix_caching", "chunked"),
    [(0, True, True), (1, True, True), (2, False, True), (3, True, False), (4, True, True)],
)
def test_fuzz_arrivals_aborts_and_preemption(
    seed: int, prefix_caching: bool, chunked: bool
) -> None:
    rng = random.Random(seed)
    max_model_len = 48
    num_blocks = 16  # 64 token slots: a few long requests at once force preemption
    sched = make_scheduler(
        num_blocks,
        max_num_seqs=6,
        budget=24 if chunked else max_model_len,
        max_model_len=max_model_len,
        prefix_caching=prefix_caching,
        chunked=chunked,
    )
    runner = FakeRunner(num_blocks)
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(12)] for _ in range(3)]
    requests: dict[str, Request] = {}
    produced: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    aborted: set[str] = set()
    clock = 0.0
    num_steps = 0
    while num_steps < 3000 and (len(requests) < 60 or sched.has_unfinished_requests()):
        num_steps += 1
        if len(requests) < 60 and rng.random() < 0.4:
            clock += rng.choice([0.0, 1.0])  # equal arrival times happen
            tail = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(0, 16))]
            prompt = (
                rng.choice(prefixes)[: rng.randrange(1, 13)] if rng.random() < 0.6 else []
            ) + tail
            if not prompt:
                prompt = [rng.randrange(1, VOCAB)]
            max_tokens = rng.choice([None, rng.randrange(1, max_model_len - len(prompt) + 1)])
            request = make_request(
                f"r{len(requests)}",
                prompt,
                priority=rng.randrange(0, 3),
                arrival=clock,
                salt=rng.choice([None, None, "x"]),
                max_tokens=max_tokens,
                min_tokens=rng.choice([0, 0, 2]) if max_tokens is None or max_tokens >= 2 else 0,
                ignore_eos=rng.random() < 0.3,
            )
            sched.add_request(request)
            requests[request.request_id] = request
            produced[request.request_id] = []
        if rng.random() < 0.05 and sched.has_unfinished_requests():
            victim = rng.choice(sorted(sched.requests))
            sched.abort_requests([victim])
            aborted.add(victim)
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= sched.config.max_num_seqs
        runner_output = runner.execute(out)
        assert set(runner.reqs) == {r.request_id for r in sched.running}
        for r in sched.running:
            assert runner.reqs[r.request_id].block_ids == sched.kv_cache.get_block_ids(r.request_id)
        for o in sched.update(out, runner_output):
            assert o.req_id not in finish
            produced[o.req_id] += o.new_token_ids
            if o.finish_reason is not None:
                finish[o.req_id] = o.finish_reason
    assert not sched.has_unfinished_requests(), "did not drain"
    sched.schedule()  # flush finished ids to the runner
    assert_all_blocks_free(sched)

    stats = sched.make_stats()
    assert stats.num_preemptions > 0
    if prefix_caching:
        assert stats.prefix_cache_hits > 0
    for req_id, request in requests.items():
        if req_id in aborted:
            assert request.status == RequestStatus.FINISHED_ABORTED
            continue
        tokens, reason = expected_tokens(request, max_model_len)
        assert produced[req_id] == tokens, req_id
        assert request.output_token_ids == tokens
        assert finish[req_id] == reason
