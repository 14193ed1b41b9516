"""One small dataclass per engine subsystem, each field documented and validated."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.spec_decode.config import SpeculativeConfig


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-family decoder, read from config.json or GGUF metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style rope_scaling dict ({"rope_type": "llama3", "factor": ..., ...}) or None.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    # Qwen2-style checkpoints carry a bias on the q/k/v projections.
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")


# "auto" stores K/V in the model's dtype; the others in one byte per element.
KV_CACHE_DTYPES = ("auto", "fp8", "int8")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache."""

    # Tokens per KV block.
    block_size: int = 16
    # Bytes of K and V blocks together, over all layers. The block count is derived from it.
    kv_cache_memory_bytes: int = 1 << 30
    # Share full prompt blocks across requests by content hash.
    enable_prefix_caching: bool = True
    # Element type of the K/V blocks: "auto" (the model's dtype), or one byte per element,
    # "fp8" (e4m3) or "int8", with per-block-per-head scales (runner/kv_quantization.py).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """What one engine step may schedule."""

    # Most sequences in one step (running decodes plus prefills).
    max_num_seqs: int = 64
    # Token budget of one step: decodes cost 1 each, prefills are chunked to fit.
    max_num_batched_tokens: int = 512
    # Longest prompt + output a request may reach.
    max_model_len: int = 8192
    # Long prompts are split into chunks of at most the remaining token budget.
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len"
            )


@dataclass(frozen=True)
class DeviceConfig:
    """Where the engine runs and in what precision."""

    device: str = "cpu"
    # "float32" or "bfloat16"; "auto" picks the faster one for the device.
    dtype: str = "auto"
    # CPU threads for torch; None keeps torch's default.
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass(frozen=True)
class EngineConfig:
    """Everything EngineCore needs, one dataclass per subsystem."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    # Weight-only quantization of the decoder projections; None: the model's dtype.
    quantization: QuantConfig | None = None
    # Speculative decoding; None: off.
    speculative: SpeculativeConfig | None = None
