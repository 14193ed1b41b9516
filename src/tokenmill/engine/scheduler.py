"""The scheduler: which tokens of which requests the next engine step computes.

There is no prefill phase and no decode phase. Every request has `num_computed_tokens`
(tokens whose K/V are in its blocks) and `num_tokens` (prompt + generated); a step gives
each scheduled request some of its missing tokens, and the model runner samples a next
token for every request whose computed tokens then reach `num_tokens`. A decode is a
request missing one token; a prefill is a request missing many, cut into chunks that fit
the step's token budget (chunked prefill). So one step mixes decodes and prefill chunks.

Each step, under a budget of `max_num_batched_tokens` tokens and `max_num_seqs` requests:

1. Priority preemption. While the best waiting request has a strictly better priority
   (lower value) than the worst running one and cannot be admitted (no free seat, or too
   few free blocks for its first chunk after the running requests' next chunks), the worst
   running request is preempted. Done before anything is allocated this step, so no block
   handed out this step is ever freed again in the same step.
2. Running requests, best priority first, get their missing tokens (capped by the budget).
   When one cannot get blocks, the worst running request (highest priority value, then
   latest arrival) is preempted by recompute: its blocks are freed, it goes back to the
   waiting queue at its old place, and it will recompute prompt and generated tokens
   (mostly from the prefix cache) when resumed. If the request itself is the worst, it
   is the one preempted.
3. Waiting requests, ordered by (priority, arrival time, insertion order), join while the
   budget, seats and blocks last, each starting from its prefix-cache hit. The queue is
   strict: the first one that does not fit stops admission (no overtaking). Skipped in a
   step that preempted in phase 2 (the cache is under pressure).

Speculative decoding (when a SpecDecodePolicy is given): a decoding request may carry
draft tokens the runner proposed after the previous step (`request.spec_token_ids`). Phase
2 schedules `1 + d` tokens for it, where the policy picks d per request from its acceptance
and the step's measured cost (d = 0: no speculation this step), never more drafts than
max_tokens or max_model_len leave room for. The drafts travel in `spec_token_ids`, and
`num_spec_to_propose` tells the runner how many to propose for the next step (a draft
model also gets that many lookahead slots to write its K/V in). `update` takes the tokens
the runner accepted (accepted drafts, then the one token the target sampled after them),
rolls `num_computed_tokens` back over the rejected drafts and gives their blocks back.

The runner hears about requests as diffs (SchedulerOutput): new or resumed requests whole,
running ones as appended block ids; finished, aborted and preempted ones in
`finished_req_ids` of the next output. `update` applies the runner's sampled tokens,
checks stop conditions and frees finished requests' blocks at once.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterable, Iterator

from tokenmill.engine.config import CacheConfig, SchedulerConfig
from tokenmill.engine.kv_cache.manager import KVCacheManager
from tokenmill.engine.outputs import EngineCoreOutput, Logprob, PositionLogprobs
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.runner.output import LogprobsTensors, ModelRunnerOutput
from tokenmill.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.engine.spec_decode.policy import SpecDecodePolicy
from tokenmill.engine.stats import SchedulerStats

logger = logging.getLogger(__name__)

_QueueKey = tuple[int, float, int]
# The speculation plan's stand-in for a request admitted this step.
_NEW = "\0new"


class _RequestQueue:
    """Requests sorted by a key, best (smallest) first."""

    def __init__(self, key: Callable[[Request], _QueueKey]) -> None:
        self._key = key
        self._items: list[Request] = []

    def add(self, request: Request) -> None:
        bisect.insort(self._items, request, key=self._key)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.pop(0)

    def remove(self, request: Request) -> None:
        self._items.remove(request)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        spec_policy: SpecDecodePolicy | None = None,
        spec_lookahead: bool = False,
    ) -> None:
        """`spec_policy` enables speculative decoding; `spec_lookahead` reserves slots for
        the proposer's own K/V writes (a draft model; n-gram writes none)."""
        self.config = scheduler_config
        self.spec_policy = spec_policy
        self.spec_lookahead = spec_lookahead
        self.block_size = cache_config.block_size
        self.kv_cache = KVCacheManager(
            num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        # Unfinished requests (waiting, running or preempted).
        self.requests: dict[str, Request] = {}
        self.waiting = _RequestQueue(self._queue_key)
        # Sorted by the same key: running[-1] is the preemption victim.
        self.running: list[Request] = []
        self._insertion_order: dict[str, int] = {}
        self._num_added = 0
        # Finished, aborted or preempted since the last schedule(): the runner drops them.
        self._finished_req_ids: set[str] = set()
        # Prompt positions whose logprobs were emitted (survives preemption: no repeats).
        self._num_prompt_logprobs_sent: dict[str, int] = {}
        self._num_preemptions = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_steps = 0
        self._num_scheduled_tokens = 0
        # Speculative decoding counters: drafts verified, drafts accepted, and how many
        # verifications accepted 0, 1, ... k drafts.
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._acceptance_lengths: list[int] = []
        # req_id -> drafts to propose after this step (also its lookahead slots).
        self._num_to_propose: dict[str, int] = {}

    # ----------------------------------------------------------------- requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request; raises ValueError at once for one that can never be served."""
        req_id = request.request_id
        if req_id in self.requests:
            raise ValueError(f"request {req_id!r} already exists")
        if request.status != RequestStatus.WAITING or request.output_token_ids:
            raise ValueError(f"request {req_id!r} must be fresh (waiting, no output)")
        if request.sampling_params.n != 1:
            raise ValueError(
                f"request {req_id!r} has n={request.sampling_params.n}: fan out n > 1 "
                "into separate requests before the scheduler"
            )
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError(f"request {req_id!r} has an empty prompt")
        max_len = self.config.max_model_len
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            if num_prompt >= max_len:
                raise ValueError(
                    f"prompt of {num_prompt} tokens leaves no room to generate within "
                    f"max_model_len={max_len}"
                )
            max_total = max_len
        else:
            if num_prompt + max_tokens > max_len:
                raise ValueError(
                    f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                    f"max_model_len={max_len}"
                )
            max_total = num_prompt + max_tokens
        # The last sampled token's K/V is never written.
        num_blocks_needed = -(-(max_total - 1) // self.block_size)
        if num_blocks_needed > self.kv_cache.num_blocks:
            raise ValueError(
                f"request {req_id!r} may need {num_blocks_needed} KV blocks "
                f"({max_total} tokens) but the KV cache has {self.kv_cache.num_blocks} blocks "
                f"of {self.block_size} tokens"
            )
        self._insertion_order[req_id] = self._num_added
        self._num_added += 1
        self.requests[req_id] = request
        self.waiting.add(request)

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Abort requests wherever they are; their blocks are freed at once."""
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (stop strings, aborts). Unknown ids are ignored:
        the request may have finished on its own already."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"{status.name} is not a finished status")
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            request.status = status
            self._free_finished(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_finished_requests(self) -> bool:
        """Finished requests the runner has not been told about (one more schedule())."""
        return bool(self._finished_req_ids)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---------------------------------------------------------------------------- schedule

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        self._preempt_for_priority(output)
        drafts = self._plan_speculation()
        token_budget, preempted = self._schedule_running(
            output, self.config.max_num_batched_tokens, drafts
        )
        if not preempted:
            self._schedule_waiting(output, token_budget)
        if self.spec_policy is not None:
            fresh = self._num_to_propose.get(_NEW, 0)
            output.num_spec_to_propose = {
                r: n for r in output.num_scheduled_tokens if (n := self._num_to_propose.get(r, fresh))
            }
        output.total_num_scheduled_tokens = sum(output.num_scheduled_tokens.values())
        self._num_scheduled_tokens = output.total_num_scheduled_tokens
        return output

    def _preempt_for_priority(self, output: SchedulerOutput) -> None:
        while self.waiting and self.running:
            head, victim = self.waiting.peek(), self.running[-1]
            if head.priority >= victim.priority:
                return
            if len(self.running) < self.config.max_num_seqs and self._can_admit(head):
                return
            self._preempt(victim, output)

    def _can_admit(self, request: Request) -> bool:
        """Whether the request's first chunk fits the free blocks left once every running
        request has its next chunk."""
        budget = self.config.max_num_batched_tokens
        computed, num_hit = self.kv_cache.get_computed_blocks(request)
        num_needed = self.kv_cache.num_blocks_to_allocate(
            request, min(request.num_tokens - num_hit, budget), computed
        )
        for running in self.running:
            num_missing = running.num_tokens - running.num_computed_tokens
            num_needed += self.kv_cache.num_blocks_to_allocate(running, min(num_missing, budget))
        return num_needed <= self.kv_cache.num_free_blocks

    def _plan_speculation(self) -> dict[str, int]:
        """Drafts each running request verifies this step (req_id -> count), and, kept in
        `_num_to_propose`, how many each scheduled request proposes for the next step."""
        policy = self.spec_policy
        if policy is None:
            return {}
        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        num_sampling = max(len(decoding), 1)
        num_tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.running) or 1
        policy.step([r.request_id for r in decoding])
        available = {r.request_id: self._max_drafts(r, len(r.spec_token_ids)) for r in decoding}
        drafts = policy.plan(available, num_tokens, num_sampling)
        if logger.isEnabledFor(logging.DEBUG) and available:
            logger.debug(
                "speculation: %d tokens, drafts available %s, verified %s, alpha %s",
                num_tokens, available, drafts, {r: round(policy.alpha(r), 2) for r in available},
            )
        # Next step's proposals: what the policy would verify then with k drafts in hand,
        # every running request decoding. A request admitted now joins them as a fresh
        # one. A proposer without a model (n-gram) costs nothing to ask: it proposes all k
        # whenever the request would speculate at all, and the next plan picks.
        k = policy.max_tokens
        batch = max(len(self.running), 1)
        proposals = policy.plan({r.request_id: k for r in self.running}, batch, batch)
        fresh = policy.plan({_NEW: k}, len(self.running) + 1, len(self.running) + 1)
        proposals[_NEW] = fresh.get(_NEW, 0)
        if not self.spec_lookahead:
            proposals = {r: k for r, n in proposals.items() if n > 0}
        self._num_to_propose = {r.request_id: proposals.get(r.request_id, 0) for r in self.running}
        self._num_to_propose[_NEW] = proposals.get(_NEW, 0)
        return drafts

    def _max_drafts(self, request: Request, num_drafts: int) -> int:
        """Drafts a decoding request may verify: accepting them all plus the bonus token
        must stay within max_tokens and max_model_len."""
        room = self.config.max_model_len - request.num_tokens - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return max(0, min(num_drafts, room))

    def _lookahead(self, request: Request, num_new: int) -> int:
        """Slots to reserve past the scheduled tokens for the proposer's K/V writes."""
        if not self.spec_lookahead:
            return 0
        n = self._num_to_propose.get(request.request_id)
        n = self._num_to_propose.get(_NEW, 0) if n is None else n
        return max(0, min(n, self.config.max_model_len - request.num_computed_tokens - num_new))

    def _schedule_running(
        self, output: SchedulerOutput, token_budget: int, drafts: dict[str, int]
    ) -> tuple[int, bool]:
        """Give running requests their missing tokens (and the drafts planned for them);
        returns (budget left, preempted)."""
        preempted = False
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            assert request.status == RequestStatus.RUNNING, request
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            num_new = min(num_new, self.config.max_model_len - request.num_computed_tokens)
            if num_new <= 0:
                index += 1
                continue
            num_drafts = min(drafts.get(request.request_id, 0), token_budget - num_new)
            request.spec_token_ids = request.spec_token_ids[:num_drafts]
            num_new += num_drafts
            num_kept = self.kv_cache.num_blocks_of(request.request_id)
            lookahead = self._lookahead(request, num_new)
            new_blocks = self.kv_cache.allocate_slots(request, num_new, None, lookahead)
            while new_blocks is None:
                # running[-1] sorts after `request`, so it was not scheduled this step.
                victim = self.running[-1]
                self._preempt(victim, output)
                preempted = True
                if victim is request:
                    break
                new_blocks = self.kv_cache.allocate_slots(request, num_new, None, lookahead)
            if new_blocks is None:
                break
            output.cached_reqs.append(
                CachedRequestData(
                    request.request_id, new_blocks.block_ids, request.num_computed_tokens, num_kept
                )
            )
            if num_drafts:
                output.spec_token_ids[request.request_id] = list(request.spec_token_ids)
            output.num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new
            index += 1
        return token_budget, preempted

    def _schedule_waiting(self, output: SchedulerOutput, token_budget: int) -> None:
        while self.waiting and token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            assert not request.is_finished, request
            computed, num_hit = self.kv_cache.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > token_budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = token_budget
            lookahead = self._lookahead(request, num_hit + num_new)
            if self.kv_cache.allocate_slots(request, num_new, computed, lookahead) is None:
                return
            self.waiting.pop()
            self._start_running(request, num_hit)
            output.new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=self.kv_cache.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit,
                )
            )
            output.num_scheduled_tokens[request.request_id] = num_new
            token_budget -= num_new

    def _start_running(self, request: Request, num_hit: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
            request.num_cached_tokens = num_hit
        bisect.insort(self.running, request, key=self._queue_key)

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        """Preempt by recompute: free the blocks, back to the waiting queue at its place."""
        assert request.request_id not in output.num_scheduled_tokens, request
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.add(request)
        output.finished_req_ids.add(request.request_id)

    # ------------------------------------------------------------------------------ update

    def update(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one executed step: advance, append sampled tokens, stop, free."""
        self._num_steps += 1
        rows = {req_id: row for row, req_id in enumerate(runner_output.req_ids)}
        sampled_logprobs = _LogprobRows(runner_output.logprobs)
        # Logprob rows are flattened over the requests' sampled tokens, in order.
        sampled_logprobs_offsets = [0]
        for tokens in runner_output.sampled_token_ids:
            sampled_logprobs_offsets.append(sampled_logprobs_offsets[-1] + len(tokens))
        outputs: list[EngineCoreOutput] = []
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            start = request.num_computed_tokens
            num_drafts = len(scheduler_output.spec_token_ids.get(req_id, ()))
            request.num_computed_tokens += num_scheduled
            new_token_ids: list[int] = []
            new_logprobs: list[PositionLogprobs] | None = None
            grammar_ended = False
            row = rows.get(req_id)
            caught_up = request.num_computed_tokens == request.num_tokens + num_drafts
            assert caught_up == (row is not None), (
                f"{req_id}: a request samples exactly when it has computed all its tokens"
            )
            if row is not None:
                sampled = runner_output.sampled_token_ids[row]
                num_accepted = len(sampled) - 1
                assert 0 <= num_accepted <= num_drafts, (req_id, sampled, num_drafts)
                if num_drafts:
                    # The rejected drafts' K/V is garbage: uncompute it, give its blocks back.
                    request.num_computed_tokens -= num_drafts - num_accepted
                    self._record_acceptance(req_id, num_drafts, num_accepted)
                request.spec_token_ids = []
                new_token_ids = self._take_tokens(request, sampled)
                k = request.sampling_params.logprobs
                if k is not None:
                    first_row = sampled_logprobs_offsets[row]
                    new_logprobs = [
                        sampled_logprobs.position(first_row + i, k) for i in range(len(new_token_ids))
                    ]
                # Unless a stop token or max_tokens among the accepted drafts ended it:
                if not request.is_finished:
                    if req_id in runner_output.stopped_req_ids:
                        request.status = RequestStatus.FINISHED_STOPPED  # its grammar ended
                        grammar_ended = new_token_ids[-1] not in request.eos_token_ids
                    elif req_id in runner_output.failed_req_ids:
                        request.status = RequestStatus.FINISHED_ABORTED
                    else:
                        self._check_stop(request)
                if not request.is_finished:
                    if num_drafts:
                        self.kv_cache.truncate(request, request.num_tokens)
                    request.spec_token_ids = runner_output.spec_token_ids.get(req_id, [])
            prompt_logprobs = self._take_prompt_logprobs(
                request, start, runner_output.prompt_logprobs.get(req_id)
            )
            if new_token_ids or prompt_logprobs or request.is_finished:
                outputs.append(
                    EngineCoreOutput(
                        req_id=req_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=new_logprobs,
                        new_prompt_logprobs=prompt_logprobs,
                        finish_reason=request.finish_reason,
                        stop_reason=request.stop_reason,
                        grammar_ended=grammar_ended,
                        num_cached_tokens=request.num_cached_tokens,
                        first_scheduled_time=request.first_scheduled_time,
                    )
                )
            if request.is_finished:
                self._free_finished(request)
        return outputs

    def _take_tokens(self, request: Request, sampled: list[int]) -> list[int]:
        """Append a step's tokens, stopping early at a stop condition met before the last
        one (the last is checked by the caller, who knows about grammar ends)."""
        for i, token_id in enumerate(sampled):
            self._append_token(request, token_id)
            if i < len(sampled) - 1:
                self._check_stop(request)
                if request.is_finished:
                    return sampled[: i + 1]
        return sampled

    def _record_acceptance(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        assert self.spec_policy is not None
        self.spec_policy.record(req_id, num_drafts, num_accepted)
        self._num_draft_tokens += num_drafts
        self._num_accepted_tokens += num_accepted
        lengths = self._acceptance_lengths
        if len(lengths) <= num_accepted:
            lengths.extend([0] * (num_accepted + 1 - len(lengths)))
        lengths[num_accepted] += 1

    def _append_token(self, request: Request, token_id: int) -> None:
        if request.num_output_tokens == 0:
            request.first_token_time = time.monotonic()
            self._num_prompt_tokens += request.num_prompt_tokens
        request.append_output_token(token_id)
        self._num_generation_tokens += 1

    def _check_stop(self, request: Request) -> None:
        """Stop on EOS / stop token ids (never among the first min_tokens tokens, which
        the sampler also masks), else on max_tokens or max_model_len."""
        params = request.sampling_params
        token_id = request.output_token_ids[-1]
        if request.num_output_tokens > params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return
        max_tokens = params.max_tokens
        if (max_tokens is not None and request.num_output_tokens >= max_tokens) or (
            request.num_tokens >= self.config.max_model_len
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def _take_prompt_logprobs(
        self, request: Request, start: int, tensors: LogprobsTensors | None
    ) -> list[PositionLogprobs | None] | None:
        """Prompt logprobs computed this step, each position emitted once.

        Row i of `tensors` is prompt position start + 1 + i (logits at position p score
        token p + 1). Position 0 has no logprob: its None goes out with the first chunk.
        Positions recomputed after a preemption are not sent again.
        """
        k = request.sampling_params.prompt_logprobs
        if k is None:
            return None
        req_id = request.request_id
        num_sent = self._num_prompt_logprobs_sent.get(req_id, 0)
        num_prompt = request.num_prompt_tokens
        entries: list[PositionLogprobs | None] = []
        if num_sent == 0 and start == 0:
            entries.append(None)
            num_sent = 1
        if tensors is not None:
            rows = _LogprobRows(tensors)
            for row in range(rows.num_rows):
                position = start + 1 + row
                if position < num_sent:
                    continue
                if position >= num_prompt:
                    break
                assert position == num_sent, f"{req_id}: prompt logprob gap at {position}"
                entries.append(rows.position(row, k))
                num_sent += 1
        self._num_prompt_logprobs_sent[req_id] = num_sent
        return entries or None

    def _free_finished(self, request: Request) -> None:
        assert request.is_finished, request
        req_id = request.request_id
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        del self.requests[req_id]
        del self._insertion_order[req_id]
        self._num_prompt_logprobs_sent.pop(req_id, None)
        self._num_to_propose.pop(req_id, None)
        if self.spec_policy is not None:
            self.spec_policy.remove(req_id)
        self._finished_req_ids.add(req_id)

    # ------------------------------------------------------------------------------- stats

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache.make_prefix_cache_stats()
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            num_kv_blocks_used=self.kv_cache.num_blocks - self.kv_cache.num_free_blocks,
            num_kv_blocks_total=self.kv_cache.num_blocks,
            prefix_cache_queries=prefix.num_queries,
            prefix_cache_hits=prefix.num_hits,
            num_preemptions=self._num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_steps=self._num_steps,
            num_scheduled_tokens=self._num_scheduled_tokens,
            spec_decode_num_draft_tokens=self._num_draft_tokens,
            spec_decode_num_accepted_tokens=self._num_accepted_tokens,
            spec_decode_acceptance_lengths=tuple(self._acceptance_lengths),
        )

    def _queue_key(self, request: Request) -> _QueueKey:
        return (request.priority, request.arrival_time, self._insertion_order[request.request_id])


class _LogprobRows:
    """LogprobsTensors as Python lists, converted once, on first use."""

    def __init__(self, tensors: LogprobsTensors | None) -> None:
        self._tensors = tensors
        self._lists: tuple[list[list[int]], list[list[float]], list[int]] | None = None

    @property
    def num_rows(self) -> int:
        return 0 if self._tensors is None else int(self._tensors.token_ids.shape[0])

    def position(self, row: int, k: int) -> PositionLogprobs:
        """Row `row` as {token: Logprob}: the chosen token first, then the top k."""
        if self._lists is None:
            assert self._tensors is not None, "logprobs asked for but the runner sent none"
            t = self._tensors
            self._lists = (t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist())
        token_ids, logprobs, ranks = self._lists[0][row], self._lists[1][row], self._lists[2][row]
        assert k < len(token_ids), f"asked for top {k}, the runner sent {len(token_ids) - 1}"
        entry: PositionLogprobs = {token_ids[0]: Logprob(logprobs[0], ranks)}
        for rank in range(1, k + 1):
            entry.setdefault(token_ids[rank], Logprob(logprobs[rank], rank))
        return entry
