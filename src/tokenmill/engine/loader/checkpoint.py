"""Checkpoint: a model's config, float32 weights and tokenizer, from a GGUF file or an HF dir.

`load_checkpoint` is the engine's one way in: it dispatches on the path (a `.gguf` file,
or a directory holding config.json), then checks that the weights are exactly the set
of HF-named tensors the config implies, with the shapes it implies, so a truncated or
mismatched checkpoint fails here with a clear message rather than deep inside the model.
Loading never touches the network.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.loader.gguf import load_gguf
from tokenmill.engine.loader.safetensors import (
    HFDirectory,
    load_safetensors_weights,
    model_config_from_hf,
    quantization_from_hf,
)
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.quantization.weights import QuantizedWeight


@dataclass
class Checkpoint:
    config: ModelConfig
    # HF transformers names -> float32 tensors (or QuantizedWeights kept from GGUF blocks).
    weights: dict[str, Any]
    tokenizer: Tokenizer
    # The file or directory it was read from.
    source: str
    # The scheme of the weights stored quantized (QuantizedWeights above), if any.
    quantization: QuantConfig | None = None


def load_checkpoint(path: str | Path, keep_int4: bool = False, keep_int8: bool = False) -> Checkpoint:
    """Load a `.gguf` file or an HF checkpoint directory. `keep_int4`: a GGUF's Q4_0/Q4_1
    projections stay int4 codes; `keep_int8`: its Q8_0 ones become int8 codes (load_gguf)."""
    path = Path(path).expanduser()
    quantization: QuantConfig | None = None
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf checkpoint")
        contents = load_gguf(path, keep_int4=keep_int4, keep_int8=keep_int8)
        config, weights = contents.config, contents.weights
        tokenizer = Tokenizer.from_gguf(contents.metadata)
        kept = {w.method for w in weights.values() if isinstance(w, QuantizedWeight)}
        if kept:
            (method,) = kept  # one of keep_int4 / keep_int8 is asked for at a time
            quantization = QuantConfig(method, 32)
    else:
        directory = HFDirectory.open(path)
        config = model_config_from_hf(directory.config, directory.generation_config)
        quantization = quantization_from_hf(directory.config)
        weights = load_safetensors_weights(directory.path, config, quantization)
        tokenizer = Tokenizer.from_file(
            directory.tokenizer_file,
            directory.tokenizer_config,
            extra_eos_token_ids=config.eos_token_ids,
            chat_template=directory.chat_template,
        )
    check_weights(weights, config)
    return Checkpoint(
        config=config, weights=weights, tokenizer=tokenizer, source=str(path), quantization=quantization
    )


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name a Llama-family checkpoint of this config holds, with its shape."""
    hidden, ffn = config.hidden_size, config.intermediate_size
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (hidden,),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q_rows, hidden),
            layer + "self_attn.k_proj.weight": (kv_rows, hidden),
            layer + "self_attn.v_proj.weight": (kv_rows, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_rows),
            layer + "mlp.gate_proj.weight": (ffn, hidden),
            layer + "mlp.up_proj.weight": (ffn, hidden),
            layer + "mlp.down_proj.weight": (hidden, ffn),
        }
        if config.attention_bias:
            shapes |= {
                layer + "self_attn.q_proj.bias": (q_rows,),
                layer + "self_attn.k_proj.bias": (kv_rows,),
                layer + "self_attn.v_proj.bias": (kv_rows,),
            }
    return shapes


def check_weights(weights: Mapping[str, Any], config: ModelConfig) -> None:
    """ValueError unless `weights` holds exactly the expected tensors with the expected shapes."""
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"checkpoint tensors do not match its config: missing {missing[:4]} "
            f"({len(missing)} in all), unexpected {unexpected[:4]} ({len(unexpected)} in all)"
        )
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ValueError(
                f"tensor {name} has shape {tuple(weights[name].shape)}, config implies {shape}"
            )
