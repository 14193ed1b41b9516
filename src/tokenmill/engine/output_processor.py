"""Token-level engine outputs -> text-level RequestOutput deltas, per parent request.

A request with n > 1 fans out into n child engine requests `"{id}#{i}"` (params.child(i):
n = 1 and a distinct derived seed); with n = 1 the single child keeps the parent's id.
Each child carries its own incremental detokenizer and stop-string checker. For every
batch of EngineCoreOutputs, `process` feeds each child's new tokens through both, one
token at a time:

    token -> text delta -> stop-string match (once past min_tokens) -> streamable text

A matched stop string ends the child here: tokens after the one that completed it are
dropped, its finish_reason is "stop" with the string as stop_reason, and its id is
returned so the engine frees it. A stop token (eos or stop_token_ids) keeps its id in
token_ids but adds no text unless include_stop_str_in_output. Each parent that
progressed gets one delta: only the children that progressed, with their new text,
token ids and logprobs (trimmed to what was asked, decoded_token filled), the child's
cumulative logprob so far, and `finished` once every child has finished. Prompt
logprobs, from whichever child computed them first, come once, complete, in the first
delta after they are (in practice the first delta).

Per parent only what later deltas need is kept; finished parents are dropped at once.
`RequestOutputAccumulator` folds the deltas back into cumulative outputs for the offline
API.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.engine.detokenizer import IncrementalDetokenizer, TokenizerLike
from tokenmill.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from tokenmill.engine.request import FinishReason, SamplingParams
from tokenmill.engine.stop_checker import StopChecker


@dataclass
class _Child:
    req_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    # None unless the request asked for logprobs.
    cumulative_logprob: float | None
    num_output_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    children: list[_Child] = field(default_factory=list)
    num_finished: int = 0
    num_cached_tokens: int = 0
    # Prompt logprobs as they arrive (chunked prefill), from one child only.
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    prompt_logprobs_source: str | None = None
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    """Detokenizes, applies stop strings and aggregates n samples into parent deltas."""

    def __init__(
        self, tokenizer: TokenizerLike, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.tokenizer = tokenizer
        self._clock = clock
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Child]] = {}
        # token id -> its text alone, for Logprob.decoded_token (bounded by the vocabulary).
        self._token_text: dict[int, str] = {}

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> list[tuple[str, SamplingParams]]:
        """Track a request; return the (child id, params) engine requests to submit."""
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = self._clock() if arrival_time is None else arrival_time
        parent = _Parent(
            request_id, prompt, list(prompt_token_ids), params, RequestMetrics(arrival)
        )
        if params.n == 1:
            children = [(request_id, params)]
        else:
            children = [(f"{request_id}#{i}", params.child(i)) for i in range(params.n)]
        for index, (child_id, child_params) in enumerate(children):
            child = _Child(
                req_id=child_id,
                index=index,
                params=child_params,
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, parent.prompt_token_ids, child_params.skip_special_tokens
                ),
                stop_checker=StopChecker(
                    child_params.stop, child_params.include_stop_str_in_output
                ),
                cumulative_logprob=None if child_params.logprobs is None else 0.0,
            )
            parent.children.append(child)
            self._children[child_id] = (parent, child)
        self._parents[request_id] = parent
        return children

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; return its unfinished child ids for the engine to abort."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return []
        for child in parent.children:
            self._children.pop(child.req_id, None)
        return [c.req_id for c in parent.children if c.finish_reason is None]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """One delta per parent that progressed, and the child ids stopped by a stop string
        (the engine must finish those)."""
        now = self._clock()
        progressed: dict[str, list[CompletionOutput]] = {}
        stopped: list[str] = []
        for output in outputs:
            located = self._children.get(output.req_id)
            if located is None:
                continue  # aborted, or finished here while the engine's output was in flight
            parent, child = located
            if child.finish_reason is not None:
                continue
            if output.new_prompt_logprobs:
                self._collect_prompt_logprobs(parent, child, output.new_prompt_logprobs)
            if child.index == 0:
                parent.num_cached_tokens = max(parent.num_cached_tokens, output.num_cached_tokens)
            if parent.metrics.first_scheduled_time is None:
                parent.metrics.first_scheduled_time = output.first_scheduled_time
            completion = self._advance(child, output)
            if completion is None:
                continue
            if completion.token_ids:
                if parent.metrics.first_token_time is None:
                    parent.metrics.first_token_time = now
                parent.metrics.last_token_time = now
            if completion.finished:
                parent.num_finished += 1
                if not output.finished:
                    stopped.append(child.req_id)
            progressed.setdefault(parent.request_id, []).append(completion)
        deltas = [
            self._delta(self._parents[rid], completions, now)
            for rid, completions in progressed.items()
        ]
        return deltas, stopped

    def _advance(self, child: _Child, output: EngineCoreOutput) -> CompletionOutput | None:
        """Feed one child's new tokens through detokenizer and stop checker."""
        params, checker = child.params, child.stop_checker
        new_ids = output.new_token_ids
        # A stop token (EOS, or one of stop_token_ids: then it is the stop_reason) ends the
        # request as the last new token and adds no text by default. A request stopped by
        # its grammar's end ends on a content token.
        ends_with_stop_token = (
            output.finish_reason is FinishReason.STOP
            and not isinstance(output.stop_reason, str)
            and not output.grammar_ended
        )
        token_ids: list[int] = []
        logprobs: list[PositionLogprobs] = []
        for i, token_id in enumerate(new_ids):
            token_ids.append(token_id)
            child.num_output_tokens += 1
            if output.new_logprobs is not None:
                position = output.new_logprobs[i]
                if child.cumulative_logprob is not None:
                    child.cumulative_logprob += position[token_id].logprob
                if params.logprobs is not None:
                    logprobs.append(self._trim(position, params.logprobs))
            if (
                ends_with_stop_token
                and i == len(new_ids) - 1
                and not params.include_stop_str_in_output
            ):
                break
            text = child.detokenizer.decode_next(token_id)
            if checker.append(text, check=child.num_output_tokens > params.min_tokens) is not None:
                break
        if checker.stop_reason is not None:
            child.finish_reason, child.stop_reason = str(FinishReason.STOP), checker.stop_reason
        elif output.finish_reason is not None:
            child.finish_reason, child.stop_reason = str(output.finish_reason), output.stop_reason
        text = checker.take_stream_delta(final=child.finish_reason is not None)
        if not token_ids and not text and child.finish_reason is None:
            return None
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=child.cumulative_logprob,
            logprobs=logprobs if params.logprobs is not None else None,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
        )

    def _delta(
        self, parent: _Parent, completions: list[CompletionOutput], now: float
    ) -> RequestOutput:
        finished = parent.num_finished == len(parent.children)
        prompt_logprobs = None
        wanted = parent.params.prompt_logprobs is not None
        if (
            wanted
            and not parent.prompt_logprobs_sent
            and len(parent.prompt_logprobs) >= len(parent.prompt_token_ids)
        ):
            prompt_logprobs, parent.prompt_logprobs_sent = parent.prompt_logprobs, True
        if finished:
            parent.metrics.finished_time = now
            del self._parents[parent.request_id]
            for child in parent.children:
                self._children.pop(child.req_id, None)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=sorted(completions, key=lambda c: c.index),
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=dataclasses.replace(parent.metrics),
        )

    def _collect_prompt_logprobs(
        self, parent: _Parent, child: _Child, chunk: list[PositionLogprobs | None]
    ) -> None:
        k = parent.params.prompt_logprobs
        if k is None or parent.prompt_logprobs_sent:
            return
        if parent.prompt_logprobs_source is None:
            parent.prompt_logprobs_source = child.req_id
        if parent.prompt_logprobs_source == child.req_id:
            parent.prompt_logprobs.extend(None if p is None else self._trim(p, k) for p in chunk)

    def _trim(self, position: PositionLogprobs, k: int) -> PositionLogprobs:
        """The first entry (chosen or prompt token) plus the alternatives ranked <= k, each
        with its text. Rows arrive with the batch's largest k."""
        trimmed: PositionLogprobs = {}
        for j, (token_id, logprob) in enumerate(position.items()):
            if j == 0 or (logprob.rank <= k and token_id not in trimmed):
                trimmed[token_id] = Logprob(logprob.logprob, logprob.rank, self._decoded(token_id))
        return trimmed

    def _decoded(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text


class RequestOutputAccumulator:
    """Folds RequestOutput deltas into one cumulative RequestOutput per request."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}
        self._samples: dict[str, dict[int, CompletionOutput]] = {}

    def add(self, delta: RequestOutput) -> None:
        final = self._outputs.get(delta.request_id)
        if final is None:
            final = self._outputs[delta.request_id] = dataclasses.replace(delta, outputs=[])
            self._samples[delta.request_id] = {}
        final.finished = delta.finished
        final.metrics = delta.metrics
        final.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            final.prompt_logprobs = delta.prompt_logprobs
        samples = self._samples[delta.request_id]
        for new in delta.outputs:
            sample = samples.get(new.index)
            if sample is None:
                samples[new.index] = dataclasses.replace(
                    new,
                    token_ids=list(new.token_ids),
                    logprobs=None if new.logprobs is None else list(new.logprobs),
                )
                continue
            sample.text += new.text
            sample.token_ids.extend(new.token_ids)
            if new.logprobs is not None:
                if sample.logprobs is None:
                    sample.logprobs = []
                sample.logprobs.extend(new.logprobs)
            sample.cumulative_logprob = new.cumulative_logprob
            sample.finish_reason, sample.stop_reason = new.finish_reason, new.stop_reason

    def result(self, request_id: str) -> RequestOutput:
        """The cumulative output so far; samples in index order."""
        final = self._outputs[request_id]
        samples = self._samples[request_id]
        return dataclasses.replace(final, outputs=[samples[i] for i in sorted(samples)])
