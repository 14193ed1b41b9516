"""Engine fixtures: a tiny random-weight Llama that runs in milliseconds on CPU."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.config import ModelConfig

TINY = ModelConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    max_position_embeddings=512,
    eos_token_ids=(),
)


def tiny_weights(config: ModelConfig = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named random weights, scaled so logits are spread (distinct greedy choices)."""
    g = torch.Generator().manual_seed(seed)
    h, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    nh, kvh = config.num_heads, config.num_kv_heads

    def rnd(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    w = {
        "model.embed_tokens.weight": rnd(config.vocab_size, h, scale=1.0),
        "model.norm.weight": 1 + rnd(h, scale=0.1),
    }
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rnd(h, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(h, scale=0.1)
        w[p + "self_attn.q_proj.weight"] = rnd(nh * hd, h)
        w[p + "self_attn.k_proj.weight"] = rnd(kvh * hd, h)
        w[p + "self_attn.v_proj.weight"] = rnd(kvh * hd, h)
        w[p + "self_attn.o_proj.weight"] = rnd(h, nh * hd)
        w[p + "mlp.gate_proj.weight"] = rnd(f, h)
        w[p + "mlp.up_proj.weight"] = rnd(f, h)
        w[p + "mlp.down_proj.weight"] = rnd(h, f)
    return w


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return TINY


@pytest.fixture(scope="session")
def tiny_model_weights() -> dict[str, torch.Tensor]:
    return tiny_weights()
