"""Turns one SchedulerOutput into one forward pass and the sampled tokens.

A step flattens every scheduled token of every request into one batch of T tokens
(decodes contribute 1, prefill chunks many), so prefills and decodes share each matmul.
Inputs are gathered from the InputBatch's arrays with a handful of vectorized numpy ops;
the attention metadata is built once per step and read by all layers. Only the last
token of each request that reached the end of its known tokens is projected to logits
and sampled; a request still mid-way through a chunked prefill samples nothing.

    input_ids, positions, slot_mapping  [T]
    query_start_loc                     [R + 1]   request r owns tokens qsl[r]:qsl[r+1]
    seq_lens                            [R]       context length after this step
    block_table                         [R, max_blocks_in_step]
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.engine.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig
from tokenmill.engine.logits.pipeline import LogitsProcessorPipeline
from tokenmill.engine.logits.processor import ProcessorContext
from tokenmill.engine.models.layers.fused import select_layer_ops
from tokenmill.engine.models.layers.linear import can_prepack, prepack_linears
from tokenmill.engine.models.llama import LlamaForCausalLM, causal_attention
from tokenmill.engine.models.registry import build_model
from tokenmill.engine.quantization.apply import prepare_quantized, quantize_linears
from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.runner.attention import (
    AttentionMetadata,
    PagedAttention,
    bind_paged_attention,
)
from tokenmill.engine.runner.input_batch import InputBatch
from tokenmill.engine.runner.kv_cache_tensors import KVCacheTensors, bytes_per_block
from tokenmill.engine.runner.output import ModelRunnerOutput
from tokenmill.engine.runner.sampling_batch import SamplingBatch
from tokenmill.engine.scheduler_output import SchedulerOutput
from tokenmill.engine.spec_decode.config import SpeculativeConfig
from tokenmill.engine.spec_decode.draft_model import DraftModel
from tokenmill.engine.spec_decode.ngram import NgramLookup
from tokenmill.engine.spec_decode.policy import StepCost
from tokenmill.engine.spec_decode.proposer import Proposer
from tokenmill.engine.spec_decode.rejection import verify
from tokenmill.engine.structured_output.bitmask import masked_float
from tokenmill.engine.structured_output.compiler import GrammarCompiler
from tokenmill.engine.structured_output.processor import StructuredOutputProcessor

logger = logging.getLogger(__name__)


def resolve_dtype(device: torch.device, dtype: str) -> torch.dtype:
    """"auto": bfloat16 where the hardware has fast bf16 matmuls (AMX/AVX512-BF16, CUDA).

    Measured on the 2-core AMX machine (the 30 layers' decode matmuls, weights out of
    cache): bf16 15.8 ms vs fp32 36.4 ms at 1 row, 18.6 vs 62.6 ms at 32 rows, 29.3 vs
    103.6 ms at 64 rows: weights stream at half the bytes and AMX tiles larger batches.
    """
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and torch.backends.mkldnn.is_available():
        try:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return torch.bfloat16
        except (AttributeError, RuntimeError):
            pass
    return torch.float32


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        weights: dict[str, torch.Tensor],
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        device_config: DeviceConfig,
        logits_processors: dict[str, type[Any]] | None = None,
        grammar_compiler: GrammarCompiler | None = None,
        quantization: QuantConfig | None = None,
        speculative: SpeculativeConfig | None = None,
        draft: tuple[ModelConfig, dict[str, Any]] | None = None,
        calibration_ids: Sequence[int] | None = None,
    ) -> None:
        """`draft`: the config and weights of a separate draft model (speculative);
        `calibration_ids`: tokens that calibrate int8 weights for int8 activations
        (quantization/smoothing.py; without them int8 weights run weight-only)."""
        if device_config.num_threads is not None:
            torch.set_num_threads(device_config.num_threads)
        self.device = torch.device(device_config.device)
        self.dtype = resolve_dtype(self.device, device_config.dtype)
        self.model_config = model_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.quantization = quantization
        self.calibration_ids = calibration_ids
        self.model = self._load_model(model_config, weights)
        cache_config = self._budget_without_draft(cache_config, draft)
        self.kv_cache = KVCacheTensors.allocate(
            model_config, cache_config, self.dtype, self.device
        )
        self.attention = PagedAttention(self.device)
        # metadata -> the model's attention over this step's paged K/V.
        self._bind = bind_paged_attention(self.kv_cache, self.attention)
        self.input_batch = InputBatch(
            scheduler_config.max_num_seqs, scheduler_config.max_model_len, self.block_size
        )
        self.sampling = SamplingBatch(
            scheduler_config.max_num_seqs, model_config.vocab_size, self.device
        )
        self.eos_token_ids = model_config.eos_token_ids
        context = ProcessorContext(model_config.vocab_size, self.device, tuple(self.eos_token_ids))
        self.processors = LogitsProcessorPipeline(
            {name: cls(context) for name, cls in (logits_processors or {}).items()},
            context,
            self._history,
            StructuredOutputProcessor(context, grammar_compiler) if grammar_compiler else None,
        )
        # The float32 logits a grammar-masked step writes (grown on demand, reused every
        # step: valid only within the step that wrote them).
        self._masked_logits = torch.empty(0, model_config.vocab_size, device=self.device)
        # req_id -> top-k of the prompt logprobs it asked for (only while its prompt runs).
        self.prompt_logprobs_k: dict[str, int] = {}
        self.proposer = self._build_proposer(speculative, draft)

    def _budget_without_draft(
        self, cache: CacheConfig, draft: tuple[ModelConfig, dict[str, Any]] | None
    ) -> CacheConfig:
        """The target's share of the KV budget when a draft model keeps its own blocks of
        the same count: the budget over both models' bytes per block."""
        if draft is None:
            return cache
        target = bytes_per_block(self.model_config, cache.block_size, self.dtype, cache.kv_cache_dtype)
        both = target + bytes_per_block(draft[0], cache.block_size, self.dtype)
        return dataclasses.replace(cache, kv_cache_memory_bytes=cache.kv_cache_memory_bytes * target // both)

    def _build_proposer(
        self, config: SpeculativeConfig | None, draft: tuple[ModelConfig, dict[str, Any]] | None
    ) -> Proposer | None:
        if config is None:
            return None
        if config.method == "ngram":
            return NgramLookup(self.input_batch, config.prompt_lookup_min, config.prompt_lookup_max)
        if config.is_self_draft:
            assert config.num_layers is not None
            if config.num_layers >= self.model_config.num_layers:
                raise ValueError(
                    f"a self-draft's num_layers ({config.num_layers}) must be below the "
                    f"model's {self.model_config.num_layers} layers"
                )
            return DraftModel(
                self.model, self.input_batch, self._bind, self.device,
                num_layers=config.num_layers, shares_target_kv=True,
            )
        if draft is None:
            raise ValueError(f"draft model {config.model!r}: its weights were not loaded")
        draft_config, draft_weights = draft
        if draft_config.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({draft_config.vocab_size}) differs from the "
                f"target's ({self.model_config.vocab_size})"
            )
        model = self._load_model(draft_config, draft_weights)
        kv = KVCacheTensors.allocate_blocks(draft_config, self.num_blocks, self.block_size, self.dtype, self.device)
        return DraftModel(model, self.input_batch, bind_paged_attention(kv, self.attention), self.device)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def _load_model(self, config: ModelConfig, weights: dict[str, Any]) -> LlamaForCausalLM:
        model = build_model(config, self.max_model_len, select_layer_ops(self.device, self.dtype))
        model.load_weights(weights)
        if self.quantization is not None:
            quantize_linears(model, self.quantization, self.calibration_ids)
        model = model.to(device=self.device, dtype=self.dtype)
        prepare_quantized(model)
        # RoPE tables stay float32 (cast per step) so positions far out stay exact.
        model.rope.float()
        model.eval()
        if can_prepack(self.device, self.dtype):
            prepack_linears(model, batch_hint=self.max_num_seqs)
        return model

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_batch(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput()
        req_ids = list(sched.num_scheduled_tokens)
        inputs = self._prepare_inputs(req_ids, sched)
        begin = time.perf_counter()
        hidden = self.model(inputs.input_ids, inputs.positions, self._bind(inputs.metadata))
        sample_ids = [req_ids[i] for i in inputs.sample_req_indices]
        output = ModelRunnerOutput(req_ids=sample_ids)
        if sample_ids:
            fuse = self._fuses_grammar(sample_ids, sched)
            logits = self.model.compute_logits(hidden[inputs.logits_indices], float32=not fuse)
            # The forward's time (what the speculation policy prices), ending at a sync.
            output.forward_seconds = time.perf_counter() - begin if logits.device.type == "cpu" else None
            if sched.spec_token_ids:
                self._verify(logits, sample_ids, inputs, sched, output)
            else:
                self._sample(logits, sample_ids, inputs, output, fuse)
        self._prompt_logprobs(req_ids, inputs, hidden, output)
        if self.proposer is not None and sample_ids:
            self._propose(sample_ids, sched, output)
        return output

    def _fuses_grammar(self, sample_ids: list[str], sched: SchedulerOutput) -> bool:
        """Whether this step's grammar mask goes into the logits' float conversion: plain
        sampling whose only processing is the grammar, and no row reporting logprobs (those
        are of the distribution before any processing)."""
        processors = self.processors
        return (
            processors.active and processors.grammar_only and not sched.spec_token_ids
            and not self.sampling.wants_logprobs(sample_ids)
        )

    def _masked_out(self, num_rows: int) -> torch.Tensor:
        if self._masked_logits.shape[0] < num_rows:
            self._masked_logits = torch.empty(
                max(num_rows, 2 * self._masked_logits.shape[0]), self._masked_logits.shape[1], device=self.device
            )
        return self._masked_logits[:num_rows]

    def _sample(
        self, logits: torch.Tensor, sample_ids: list[str], inputs: _StepInputs, output: ModelRunnerOutput,
        fuse_grammar: bool = False,
    ) -> None:
        processors = self.processors
        process = None
        if fuse_grammar:
            mask = processors.grammar_mask(sample_ids)
            if mask is None:
                logits = logits.float()
            else:
                logits = masked_float(logits, *mask, out=self._masked_out(len(sample_ids)))
        elif processors.active:
            process = lambda x: processors.apply(x, sample_ids)  # noqa: E731
        tokens, logprobs = self.sampling.sample(logits, sample_ids, process)
        token_list = tokens.tolist()
        self.input_batch.append_tokens(inputs.sample_rows, np.asarray(token_list, np.int32))
        self.sampling.append_tokens(sample_ids, token_list)
        output.sampled_token_ids = [[t] for t in token_list]
        output.logprobs = logprobs
        if process is not None or fuse_grammar:
            stopped, failed = processors.record(token_list)
            output.stopped_req_ids.update(stopped)
            output.failed_req_ids.update(failed)

    def _verify(
        self,
        logits: torch.Tensor,
        sample_ids: list[str],
        inputs: _StepInputs,
        sched: SchedulerOutput,
        output: ModelRunnerOutput,
    ) -> None:
        """Speculative step: accept each request's drafts while the target agrees."""
        drafts = [sched.spec_token_ids.get(r, []) for r in sample_ids]
        result = verify(logits, sample_ids, drafts, self.sampling, self.processors)
        batch = self.input_batch
        for row, tokens in zip(inputs.sample_rows.tolist(), result.token_ids, strict=True):
            batch.append_token_list(row, tokens)
        # Rejected drafts are not computed; the scheduler agrees at the next step.
        batch.num_computed_tokens[inputs.sample_rows] = batch.num_tokens[inputs.sample_rows] - 1
        output.sampled_token_ids = result.token_ids
        output.logprobs = result.logprobs
        output.stopped_req_ids.update(result.stopped)
        output.failed_req_ids.update(result.failed)

    def _propose(self, sample_ids: list[str], sched: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Drafts for the next step, for the requests the scheduler asked and that go on."""
        assert self.proposer is not None
        done = output.stopped_req_ids | output.failed_req_ids
        ids = [r for r in sample_ids if sched.num_spec_to_propose.get(r, 0) > 0 and r not in done]
        if not ids:
            return
        drafts = self.proposer.propose(ids, [sched.num_spec_to_propose[r] for r in ids])
        if self.processors.has_constraints:
            drafts = {r: d[: self.processors.num_valid_drafts(r, d)] for r, d in drafts.items()}
        output.spec_token_ids = {r: d for r, d in drafts.items() if d}

    def _update_batch(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            if self.proposer is not None:
                self.proposer.remove(req_id)
            self.input_batch.remove(req_id)
            self.processors.remove(req_id)
            self.prompt_logprobs_k.pop(req_id, None)
            if req_id in self.sampling:
                self.sampling.remove(req_id)
        for new in sched.new_reqs:
            self.input_batch.add(new)
            params = new.sampling_params
            if params.prompt_logprobs is not None and len(new.token_ids) == new.num_prompt_tokens:
                self.prompt_logprobs_k[new.req_id] = params.prompt_logprobs
            self.processors.add(new.req_id, params)
            self.sampling.add(
                new.req_id,
                params,
                new.token_ids[: new.num_prompt_tokens],
                new.token_ids[new.num_prompt_tokens :],
                self.eos_token_ids,
            )
        for cached in sched.cached_reqs:
            self.input_batch.update(cached)
        for req_id, drafts in sched.spec_token_ids.items():
            self.input_batch.set_drafts(req_id, drafts)

    def _history(self, req_id: str) -> tuple[list[int], list[int]]:
        batch = self.input_batch
        return batch.prompt_token_ids(req_id).tolist(), batch.output_token_ids(req_id).tolist()

    def _prepare_inputs(self, req_ids: list[str], sched: SchedulerOutput) -> _StepInputs:
        batch = self.input_batch
        rows = np.fromiter((batch.row_of[r] for r in req_ids), np.int64, len(req_ids))
        num_sched = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, len(req_ids))
        cu = np.cumsum(num_sched)
        start = batch.num_computed_tokens[rows].astype(np.int64)
        spans = batch.spans(rows, start, num_sched)
        positions, query_start = spans.positions, spans.query_start
        input_ids = batch.token_ids[spans.token_rows, positions]
        seq_lens = start + num_sched
        num_drafts = batch.num_drafts[rows].astype(np.int64)
        samples = seq_lens == batch.num_tokens[rows] + num_drafts
        # A sampling request is scored at its last 1 + drafts positions.
        num_logits = (1 + num_drafts)[samples]
        logits_indices = np.repeat(cu[samples] - num_logits, num_logits) + (
            np.arange(int(num_logits.sum())) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
        )
        # The runner's own count of computed tokens moves with the step; the scheduler's
        # CachedRequestData of the next step must agree.
        batch.num_computed_tokens[rows] = seq_lens
        dev = self.device
        metadata = spans.metadata(batch, rows, seq_lens, dev)
        return _StepInputs(
            input_ids=torch.from_numpy(input_ids.astype(np.int64)).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            metadata=metadata,
            query_start=query_start,
            start=start,
            rows=rows,
            sample_req_indices=np.nonzero(samples)[0].tolist(),
            sample_rows=rows[samples],
            logits_indices=torch.from_numpy(logits_indices).to(dev),
        )

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        inputs: _StepInputs,
        hidden: torch.Tensor,
        output: ModelRunnerOutput,
    ) -> None:
        # Prompt token p (p >= 1) is scored by the logits at position p - 1. Only requests
        # that asked for prompt logprobs pay for the extra vocabulary projection.
        if not self.prompt_logprobs_k:
            return
        for i, req_id in enumerate(req_ids):
            if req_id not in self.prompt_logprobs_k:
                continue
            num_prompt = int(self.input_batch.num_prompt_tokens[inputs.rows[i]])
            first = int(inputs.start[i])
            last = min(int(inputs.start[i] + inputs.query_start[i + 1] - inputs.query_start[i]), num_prompt - 1)
            if last <= first:
                continue
            offset = int(inputs.query_start[i])
            logits = self.model.compute_logits(hidden[offset : offset + last - first])
            prompt = self.input_batch.prompt_token_ids(req_id)
            targets = torch.from_numpy(prompt[first + 1 : last + 1].astype(np.int64)).to(self.device)
            output.prompt_logprobs[req_id] = self.sampling.compute_prompt_logprobs(
                logits, targets, self.prompt_logprobs_k[req_id]
            )

    # ------------------------------------------------------------------ other passes
    @torch.inference_mode()
    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """Mean-pooled, L2-normalized final hidden states of one sequence, with no KV cache."""
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        positions = torch.arange(len(token_ids), device=self.device)
        hidden = self.model(ids, positions, causal_attention)
        pooled = hidden.float().mean(dim=0)
        return torch.nn.functional.normalize(pooled, dim=0)

    @torch.inference_mode()
    def measure_step_costs(self, num_speculative_tokens: int) -> tuple[StepCost, StepCost | None]:
        """Seconds per target forward (with logits for every token, as a speculative step
        scores every position) at 1, 2, 4, ... tokens, and per draft-model forward at 1, 2,
        4, ... rows: what the speculation policy weighs. Best of three runs per point, at
        start-up, on blocks no request owns yet."""
        limit = min(
            self.max_num_seqs * (1 + num_speculative_tokens), 128,
            self.block_size * self.kv_cache.num_blocks, self.max_model_len,
        )
        sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= limit]

        def timed(n: int, model: LlamaForCausalLM, num_layers: int | None) -> float:
            positions, metadata = self._scratch_sequence(n)
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            best = float("inf")
            for _ in range(3):
                begin = time.perf_counter()
                hidden = model(ids, positions, self._bind(metadata), num_layers)
                model.compute_logits(hidden).argmax(dim=-1).tolist()
                best = min(best, time.perf_counter() - begin)
            return best

        target = StepCost([(n, timed(n, self.model, None)) for n in sizes])
        draft = None
        if isinstance(self.proposer, DraftModel):
            rows = [n for n in sizes if n <= self.max_num_seqs]
            proposer = self.proposer
            draft = StepCost([(n, timed(n, proposer.model, proposer.num_layers)) for n in rows])
        return target, draft

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Run a throwaway forward at a few batch shapes so first requests don't pay for
        kernel builds and allocator growth. Uses block 0 before any request owns it."""
        for num_tokens in (1, 16, 64):
            n = min(num_tokens, self.block_size * self.kv_cache.num_blocks, self.max_model_len)
            positions, metadata = self._scratch_sequence(n)
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device), positions, self._bind(metadata))
            self.model.compute_logits(hidden[-1:])

    def _scratch_sequence(self, n: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """Positions and metadata of one n-token sequence in blocks 0, 1, ... (only before
        any request owns blocks: warm-up and start-up measurements)."""
        positions = torch.arange(n, device=self.device)
        metadata = AttentionMetadata.build(
            block_table=torch.arange(-(-n // self.block_size), dtype=torch.int32, device=self.device)[None],
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            slot_mapping=positions.clone(),
            max_query_len=n,
            block_size=self.block_size,
        )
        return positions, metadata


@dataclass
class _StepInputs:
    """The step's model inputs plus the numpy views the runner needs after the forward."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    query_start: np.ndarray
    start: np.ndarray
    rows: np.ndarray
    sample_req_indices: list[int]
    sample_rows: np.ndarray
    logits_indices: torch.Tensor
