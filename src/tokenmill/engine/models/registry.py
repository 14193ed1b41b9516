"""Architecture name -> model class. One entry per family the loader can describe."""

from __future__ import annotations

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.models.layers.fused import LayerOps
from tokenmill.engine.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "smollm": LlamaForCausalLM,
}


def build_model(config: ModelConfig, max_positions: int, ops: LayerOps | None = None) -> LlamaForCausalLM:
    try:
        cls = _ARCHITECTURES[config.architecture.lower()]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; supported: {sorted(_ARCHITECTURES)}"
        ) from None
    return cls(config, max_positions, ops)
