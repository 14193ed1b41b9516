"""The model shape a capacity plan needs: parameter count and the KV cache's per-token shape.

A shape comes from an HF config.json, a known model id, or explicit numbers. The
parameter count of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM), with
h = hidden_size, f = intermediate_size, V = vocab, L = layers, n = heads, k = kv heads,
d = head_dim:

    embeddings      V*h             (+ V*h for an untied lm_head)
    per layer       h*n*d           q_proj
                  + 2*h*k*d         k_proj, v_proj
                  + n*d*h           o_proj
                  + 3*h*f           gate, up, down
                  + 2*h             two RMSNorms
                  + (n*d + 2*k*d)   q/k/v biases (Qwen2 only)
    final norm      h

Llama-3-8B: 2 * 128256*4096 + 32 * 218,112,000 + 4096 = 8,030,261,248 parameters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """What memory planning needs to know about a model."""

    name: str
    num_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for field_name in ("num_params", "num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, field_name) < 1:
                raise ValueError(f"{field_name} must be >= 1, got {getattr(self, field_name)}")


@dataclass(frozen=True)
class DecoderConfig:
    """The config.json fields of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> DecoderConfig:
        def required(key: str) -> int:
            if config.get(key) is None:
                raise ValueError(f"config.json is missing {key!r}")
            return int(config[key])

        hidden, heads = required("hidden_size"), required("num_attention_heads")
        return cls(
            vocab_size=required("vocab_size"),
            hidden_size=hidden,
            intermediate_size=required("intermediate_size"),
            num_layers=required("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias", False)),
        )

    @property
    def num_params(self) -> int:
        h, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        n, k = self.num_heads, self.num_kv_heads
        per_layer = h * n * d + 2 * h * k * d + n * d * h + 3 * h * f + 2 * h
        if self.attention_bias:
            per_layer += n * d + 2 * k * d
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * per_layer + h

    def shape(self, name: str) -> ModelShape:
        return ModelShape(name, self.num_params, self.num_layers, self.num_kv_heads, self.head_dim)


# Published configs of common models (config.json values).
KNOWN_MODELS: dict[str, DecoderConfig] = {
    "llama-3-8b": DecoderConfig(128256, 4096, 14336, 32, 32, 8, 128),
    "llama-3-70b": DecoderConfig(128256, 8192, 28672, 80, 64, 8, 128),
    "llama-3.2-1b": DecoderConfig(128256, 2048, 8192, 16, 32, 8, 64, tie_word_embeddings=True),
    "mistral-7b": DecoderConfig(32768, 4096, 14336, 32, 32, 8, 128),
    "qwen2.5-7b": DecoderConfig(152064, 3584, 18944, 28, 28, 4, 128, attention_bias=True),
    "smollm2-135m-instruct": DecoderConfig(49152, 576, 1536, 30, 9, 3, 64, tie_word_embeddings=True),
}
_ALIASES = {
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
    "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    "meta-llama/Llama-3.1-8B": "llama-3-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3-8b",
    "meta-llama/Meta-Llama-3-70B": "llama-3-70b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3-70b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "mistralai/Mistral-7B-v0.3": "mistral-7b",
    "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
    "HuggingFaceTB/SmolLM2-135M-Instruct": "smollm2-135m-instruct",
}


def resolve_model(spec: str) -> ModelShape:
    """A config.json path (or a directory holding one), or a known model id."""
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return DecoderConfig.from_hf(config).shape(str(spec))
    key = _ALIASES.get(spec, spec.lower())
    if key not in KNOWN_MODELS:
        raise ValueError(
            f"model {spec!r} is not a config.json path nor a known id (known: {', '.join(sorted(KNOWN_MODELS))}); "
            "or give --params, --layers, --kv-heads and --head-dim"
        )
    return KNOWN_MODELS[key].shape(key)
