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

from tokenmill.engine.config import EngineConfig, ModelConfig
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.logits.registry import registered_processors
from tokenmill.engine.outputs import EngineCoreOutput
from tokenmill.engine.quantization.smoothing import calibration_token_ids
from tokenmill.engine.request import Request, RequestStatus, SamplingParams
from tokenmill.engine.runner.model_runner import ModelRunner
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.spec_decode.config import SpeculativeConfig
from tokenmill.engine.spec_decode.policy import SpecDecodePolicy
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
        draft: tuple[ModelConfig, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """`tokenizer` enables structured outputs (grammars are compiled against its
        vocabulary); `logits_processors` (name -> class) defaults to the installed
        `tokenmill.logits_processors` entry points; `draft` is the config and weights of
        a separate draft model (config.speculative names it)."""
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
            quantization=config.quantization, speculative=config.speculative, draft=draft,
            calibration_ids=_calibration_ids(config, tokenizer),
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
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.runner.num_blocks,
            spec_policy=self._spec_policy(config.speculative),
            spec_lookahead=config.speculative is not None and config.speculative.method == "draft",
        )
        self.last_step_time: float | None = None

    def _spec_policy(self, spec: SpeculativeConfig | None) -> SpecDecodePolicy | None:
        """The speculation policy, on this machine's forward costs (measured now)."""
        if spec is None:
            return None
        cost = draft_cost = None
        if spec.adaptive:
            cost, draft_cost = self.runner.measure_step_costs(spec.num_speculative_tokens)
            logger.info(
                "speculative decoding (%s): forward %.1f ms at 1 token, %.1f ms at %d tokens",
                spec.method, 1e3 * cost(1), 1e3 * cost(cost.tokens[-1]), cost.tokens[-1],
            )
        return SpecDecodePolicy(spec.num_speculative_tokens, cost, draft_cost, spec.adaptive)

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
        policy = self.scheduler.spec_policy
        if policy is not None and runner_output.forward_seconds is not None:
            proposer = self.runner.proposer
            policy.observe(
                scheduler_output.total_num_scheduled_tokens, runner_output.forward_seconds,
                proposer.drain_timings() if proposer is not None else (),
            )
        outputs = self.scheduler.update(scheduler_output, runner_output)
        self.last_step_time = time.monotonic()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def embed(self, token_ids: list[int]) -> list[float]:
        return self.runner.embed(token_ids).tolist()


def _calibration_ids(config: EngineConfig, tokenizer: Tokenizer | None) -> list[int] | None:
    """int8 weights quantized at load time are calibrated for int8 activations on a fixed
    text (quantization/smoothing.py), which needs the tokenizer."""
    q = config.quantization
    if tokenizer is None or q is None or q.method != "int8":
        return None
    return calibration_token_ids(tokenizer)
