"""EngineCore: the loop's body. One step = schedule -> execute -> update.

Everything above it (LLM, AsyncEngine) only adds requests, aborts them, calls step() and
turns the token-level outputs into text. Nothing here knows about HTTP or asyncio.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.logits.registry import registered_processors
from tokenmill.engine.outputs import EngineCoreOutput
from tokenmill.engine.request import Request, RequestStatus, SamplingParams
from tokenmill.engine.runner.model_runner import ModelRunner
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.stats import SchedulerStats
from tokenmill.engine.structured_output.compiler import GrammarCompiler
from tokenmill.engine.structured_output.llguidance_backend import LlguidanceBackend

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        weights: dict[str, torch.Tensor],
        tokenizer: Tokenizer | None = None,
        logits_processors: dict[str, type[Any]] | None = None,
    ) -> None:
        """`tokenizer` enables structured outputs (grammars are compiled against its
        vocabulary); `logits_processors` (name -> class) defaults to the installed
        `tokenmill.logits_processors` entry points."""
        self.config = config
        self.grammar_compiler: GrammarCompiler | None = None
        if tokenizer is not None:
            backend = LlguidanceBackend(
                tokenizer.backend.to_str(), config.model.vocab_size, tokenizer.eos_token_ids
            )
            self.grammar_compiler = GrammarCompiler(backend)
        if logits_processors is None:
            logits_processors = registered_processors()
        self.runner = ModelRunner(
            config.model, weights, config.cache, config.scheduler, config.device,
            logits_processors=logits_processors, grammar_compiler=self.grammar_compiler,
            quantization=config.quantization,
        )
        self.runner.warm_up()
        capacity = self.runner.num_blocks * config.cache.block_size
        if capacity < config.scheduler.max_model_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than max_model_len=%d: capping max_model_len",
                capacity, config.scheduler.max_model_len,
            )
            config = dataclasses.replace(
                config, scheduler=dataclasses.replace(config.scheduler, max_model_len=capacity)
            )
            self.config = config
        self.scheduler = Scheduler(config.scheduler, config.cache, self.runner.num_blocks)
        self.last_step_time: float | None = None

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError at once for one that can never be served."""
        self.check_token_ids(request.prompt_token_ids)
        vocab = self.config.model.vocab_size
        params = request.sampling_params
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or {})):
            if any(t >= vocab for t in ids):
                raise ValueError(f"{name} holds token ids outside the vocabulary [0, {vocab})")
        self.runner.processors.validate(params)
        if params.structured_outputs is not None:
            assert self.grammar_compiler is not None  # validate() refuses it otherwise
            # A cache hit when the caller compiled it off this thread (AsyncEngine does).
            self.grammar_compiler.compile(params.structured_outputs)
        self.scheduler.add_request(request)

    def add_samples(
        self,
        samples: list[tuple[str, SamplingParams]],
        prompt_token_ids: list[int],
        *,
        eos_token_ids: tuple[int, ...],
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Queue the samples of one prompt (n > 1 fans out into several); all or none."""
        added: list[str] = []
        try:
            for req_id, params in samples:
                self.add_request(
                    Request(req_id, prompt_token_ids, params, eos_token_ids=eos_token_ids,
                            priority=priority, cache_salt=cache_salt)
                )
                added.append(req_id)
        except Exception:
            self.abort_requests(added)
            raise

    def check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.config.model.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in the vocabulary [0, {vocab})")

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        self.scheduler.abort_requests(req_ids)

    def finish_requests(self, req_ids: Iterable[str]) -> None:
        """End requests stopped outside the engine (a stop string matched in the text)."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def step(self) -> list[EngineCoreOutput]:
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        outputs = self.scheduler.update(scheduler_output, runner_output)
        self.last_step_time = time.monotonic()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def embed(self, token_ids: list[int]) -> list[float]:
        return self.runner.embed(token_ids).tolist()
