"""EngineArgs: the user's knobs, turned into an EngineConfig and a loaded engine.

One place resolves a model name or path, loads the checkpoint, derives defaults
(max_model_len from the model, dtype per device) and builds the EngineCore, so the
offline LLM, the AsyncEngine and the server all start engines the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from tokenmill.engine.core import EngineCore
from tokenmill.engine.loader.checkpoint import load_checkpoint
from tokenmill.engine.loader.model_store import resolve_model
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    # "auto" (bf16 on AMX/AVX512-BF16 CPUs and CUDA, else fp32), "float32", "bfloat16".
    dtype: str = "auto"
    device: str = "cpu"
    kv_cache_memory_bytes: int = 1 << 30
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # None: the model's own context length.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    num_threads: int | None = None
    # Weight-only quantization: None, "int8", "int4" or "fp8" (see engine/quantization).
    quantization: str | None = None
    # int4 group size: 32, 64 or 128. A GGUF's Q4_0/Q4_1 blocks are taken over as they are
    # for int4 with groups of 32.
    quantization_group_size: int = 32
    # K/V block storage: "auto" (the model's dtype), "fp8" (e4m3) or "int8", one byte per
    # element with per-block scales: the same kv_cache_memory_bytes holds ~2x the tokens.
    kv_cache_dtype: str = "auto"
    # Speculative decoding: a SpeculativeConfig, its dict or JSON (see engine/spec_decode).
    speculative: SpeculativeConfig | dict[str, Any] | str | None = None

    def create_engine(self) -> tuple[EngineCore, Tokenizer]:
        # Refuse bad cache settings before the (slow) checkpoint load.
        cache = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        quantization = QuantConfig.parse(self.quantization, self.quantization_group_size)
        speculative = SpeculativeConfig.parse(self.speculative)
        path = resolve_model(self.model)
        checkpoint = load_checkpoint(
            path,
            keep_int4=quantization is not None and quantization.takes_gguf_int4,
            keep_int8=quantization is not None and quantization.takes_gguf_int8,
        )
        stored = checkpoint.quantization
        if stored is not None and quantization is not None and stored != quantization:
            raise ValueError(
                f"{path} holds {stored.method} weights"
                + (f" (groups of {stored.group_size})" if stored.method == "int4" else "")
                + f"; it cannot run as {quantization.method}"
            )
        quantization = quantization or stored
        model_config = checkpoint.config
        max_model_len = self.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context length "
                f"{model_config.max_position_embeddings}"
            )
        max_batched = self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            max_batched = max(max_batched, max_model_len)
        config = EngineConfig(
            model=model_config,
            cache=cache,
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            device=DeviceConfig(device=self.device, dtype=self.dtype, num_threads=self.num_threads),
            quantization=quantization,
            speculative=speculative,
        )
        draft = _load_draft(speculative, checkpoint.tokenizer)
        engine = EngineCore(config, checkpoint.weights, checkpoint.tokenizer, draft=draft)
        logger.info(
            "engine ready: %s, dtype %s, %d KV blocks of %d tokens (%s)",
            path, engine.runner.dtype, engine.runner.num_blocks, self.block_size,
            engine.runner.kv_cache.dtype,
        )
        return engine, checkpoint.tokenizer


def _load_draft(
    speculative: SpeculativeConfig | None, tokenizer: Tokenizer
) -> tuple[ModelConfig, dict[str, Any]] | None:
    """A separate draft model's config and weights; it must share the target's tokenizer."""
    if speculative is None or speculative.method != "draft" or speculative.is_self_draft:
        return None
    assert speculative.model is not None
    draft = load_checkpoint(resolve_model(speculative.model))
    if draft.tokenizer.backend.get_vocab() != tokenizer.backend.get_vocab():
        raise ValueError(
            f"the draft model {speculative.model!r} does not share the target's tokenizer "
            "(their vocabularies differ)"
        )
    return draft.config, draft.weights
