"""A deterministic EngineClient for server tests: no model, exact outputs.

Tokens are bytes (ids 0-255) plus one special `<eos>` (256). Sample j of a request emits,
at step i, the prompt token `prompt[(i + j) % len(prompt)]`: it echoes the prompt in a
loop, shifted per sample, until max_tokens ("length") or a stop string ("stop", text cut
before it). With `reply` set, every sample emits that text instead, one byte per step, and
ends "stop" after its last byte (as a grammar reaching its end state would), or "length"
at max_tokens. With logprobs, the chosen token is rank 1 at -0.5 and the alternatives are
the next byte values at -1.5, -2.5, ... A prompt seen before reports its leading full
4-token blocks as cached. Every call is recorded for assertions; `paused` holds all
requests before their next step (queued, not running); `step_delay_s` slows each step.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from tokenmill.engine.protocol import EngineHealth
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.stats import SchedulerStats

EOS = 256
VOCAB_SIZE = 257


class FakeTokenizer:
    vocab_size = VOCAB_SIZE
    eos_token_ids = (EOS,)
    # Ids >= 256 decode to nothing unless special tokens are kept.
    special_token_ids = frozenset(range(256, VOCAB_SIZE))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = b""
        for i in ids:
            if i < 256:
                out += bytes([i])
            elif not skip_special_tokens:
                out += b"<eos>"
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return ["<eos>" if i == EOS else bytes([i]).decode("latin-1") for i in ids]

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tools: Any = None
    ) -> str:
        if any(m["role"] == "assistant" and m["content"] == "RAISE" for m in messages):
            raise ValueError("chat template error: bad conversation")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class Call:
    prompt: list[int]
    params: SamplingParams
    request_id: str
    priority: int
    cache_salt: str | None


@dataclass
class FakeEngine:
    max_model_len: int = 256
    step_delay_s: float = 0.0
    paused: bool = False
    alive: bool = True
    ready: bool = True
    # Extra waiting requests reported by stats(), as if other clients were queued.
    extra_waiting: int = 0
    # When set, generate() raises ValueError(refuse) before yielding, as for a request the
    # engine can never serve.
    refuse: str | None = None
    # When set, generate() raises RuntimeError(fail) after the first output.
    fail: str | None = None
    # None: the real step clock; a number pins last_step_time (a hung engine).
    pinned_last_step_time: float | None = None
    # When set, the text every sample generates (see the module docstring).
    reply: str | None = None
    # Returned (and cleared) by drain_grammar_compile_times().
    grammar_compile_times: list[float] = field(default_factory=list)
    # prepare(): every params it saw, and the refusal it raises (None: accept).
    prepared: list[SamplingParams] = field(default_factory=list)
    refuse_prepare: str | None = None
    calls: list[Call] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    model_config: ModelConfig = field(
        default_factory=lambda: ModelConfig(
            vocab_size=VOCAB_SIZE, hidden_size=8, intermediate_size=16, num_layers=1,
            num_heads=2, num_kv_heads=1, head_dim=4,
        )
    )
    _running: set[str] = field(default_factory=set)
    _waiting: set[str] = field(default_factory=set)
    _seen_prompts: set[tuple[int, ...]] = field(default_factory=set)
    _last_step: float | None = None

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.calls.append(Call(ids, sampling_params, request_id, priority, cache_salt))
        if self.refuse is not None:
            raise ValueError(self.refuse)
        cached = (len(ids) // 4) * 4 if tuple(ids) in self._seen_prompts else 0
        self._seen_prompts.add(tuple(ids))
        metrics = RequestMetrics(arrival_time=time.monotonic())
        n, params = sampling_params.n, sampling_params
        max_tokens = params.max_tokens or (self.max_model_len - len(ids))
        texts = [""] * n
        done = [False] * n
        self._waiting.add(request_id)
        finished = False
        try:
            step = 0
            while not all(done):
                while self.paused:
                    await asyncio.sleep(0.005)
                self._waiting.discard(request_id)
                self._running.add(request_id)
                if metrics.first_scheduled_time is None:
                    metrics.first_scheduled_time = time.monotonic()
                    self.num_prompt_tokens += len(ids)
                await asyncio.sleep(self.step_delay_s)
                self._last_step = time.monotonic()
                self.num_steps += 1
                outputs = []
                for j in range(n):
                    if done[j]:
                        continue
                    finish = "length" if step + 1 >= max_tokens else None
                    if self.reply is not None:
                        token = self.reply.encode()[step]
                        if step + 1 == len(self.reply.encode()):
                            finish = "stop"
                    else:
                        token = ids[(step + j) % len(ids)]
                    text = self.tokenizer.decode([token])
                    for stop in params.stop:
                        cut = (texts[j] + text).find(stop)
                        if cut >= 0:
                            text, finish = (texts[j] + text)[:cut][len(texts[j]):], "stop"
                            break
                    texts[j] += text
                    done[j] = finish is not None
                    outputs.append(
                        CompletionOutput(
                            index=j,
                            text=text,
                            token_ids=[token],
                            logprobs=None if params.logprobs is None else [_position(token, params.logprobs)],
                            finish_reason=finish,
                        )
                    )
                    self.num_generation_tokens += 1
                now = time.monotonic()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.last_token_time = now
                finished = all(done)
                if finished:
                    metrics.finished_time = now
                    self.finished.append(request_id)
                prompt_logprobs = None
                if step == 0 and params.prompt_logprobs is not None:
                    prompt_logprobs = [None] + [{t: Logprob(-1.0, 1, None)} for t in ids[1:]]
                yield RequestOutput(
                    request_id=request_id,
                    prompt=None,
                    prompt_token_ids=ids,
                    outputs=outputs,
                    finished=finished,
                    prompt_logprobs=prompt_logprobs,
                    num_cached_tokens=cached,
                    metrics=RequestMetrics(**vars(metrics)),
                )
                step += 1
                if self.fail is not None:
                    raise RuntimeError(self.fail)
        finally:
            self._running.discard(request_id)
            self._waiting.discard(request_id)
            if not finished:
                self.aborted.append(request_id)

    def drain_grammar_compile_times(self) -> list[float]:
        times, self.grammar_compile_times = self.grammar_compile_times, []
        return times

    async def prepare(self, sampling_params: SamplingParams) -> None:
        """As the real engine: refuse what `refuse_prepare` says, before any stream."""
        self.prepared.append(sampling_params)
        if self.refuse_prepare is not None:
            raise ValueError(self.refuse_prepare)

    async def abort(self, request_id: str) -> None:
        if request_id in self._running or request_id in self._waiting:
            self.aborted.append(request_id)

    async def embed(self, token_ids: list[list[int]]) -> list[list[float]]:
        vectors = []
        for ids in token_ids:
            raw = [float(len(ids)), float(sum(ids) % 7), 1.0]
            norm = math.sqrt(sum(x * x for x in raw))
            vectors.append([x / norm for x in raw])
        return vectors

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self._running),
            num_waiting_reqs=len(self._waiting) + self.extra_waiting,
            num_kv_blocks_used=len(self._running),
            num_kv_blocks_total=10,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_steps=self.num_steps,
        )

    def health(self) -> EngineHealth:
        last = self._last_step if self.pinned_last_step_time is None else self.pinned_last_step_time
        return EngineHealth(
            alive=self.alive,
            ready=self.ready,
            last_step_time=last,
            has_work=bool(self._running or self._waiting),
            error=None if self.alive else "boom",
        )

    async def shutdown(self) -> None:
        self.alive = False


def _position(token: int, k: int) -> PositionLogprobs:
    position = {token: Logprob(-0.5, 1, None)}
    for r in range(k):
        alt = (token + 1 + r) % 256
        position.setdefault(alt, Logprob(-1.5 - r, r + 2, None))
    return position
