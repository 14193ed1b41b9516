"""Engine fixtures: a tiny random-weight Llama that runs in milliseconds on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.loader.chat_template import ChatTemplate
from tokenmill.engine.loader.tokenizer import Tokenizer

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


@pytest.fixture(scope="session")
def deep_tiny_model() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """TINY with 4 layers (room for a 1-3 layer self-draft)."""
    config = dataclasses.replace(TINY, num_layers=4)
    return config, tiny_weights(config, seed=3)


# A byte-level vocabulary for the constrained-decoding tests: token b < 256 is byte b
# (spelled as GPT-2's byte alphabet), 256 is the end-of-sequence token.
BYTE_EOS = 256
BYTES = dataclasses.replace(TINY, vocab_size=258, eos_token_ids=(BYTE_EOS,))


def byte_tokenizer() -> Tokenizer:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    spelling = pre_tokenizers.ByteLevel.alphabet()
    byte_to_char = {b: c for b, c in zip(range(256), _gpt2_byte_chars(), strict=True)}
    assert set(byte_to_char.values()) == set(spelling)
    vocab = {byte_to_char[b]: b for b in range(256)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<eos>", special=True), AddedToken("<pad>", special=True)])
    assert backend.token_to_id("<eos>") == BYTE_EOS
    return Tokenizer(backend, ChatTemplate("{{ messages[0]['content'] }}"), None, (BYTE_EOS,))


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable spelling of each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@pytest.fixture(scope="session")
def byte_model() -> tuple[ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    return BYTES, tiny_weights(BYTES, seed=1), byte_tokenizer()


@pytest.fixture
def make_byte_core(byte_model):
    """Factory of EngineCores on the byte model (float32 unless `dtype`, block size 16,
    tokenizer set)."""
    from tokenmill.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.runner.kv_cache_tensors import bytes_per_block

    config, weights, tokenizer = byte_model

    def make(
        *, num_blocks: int = 256, max_num_seqs: int = 16, max_batched: int = 256, speculative=None,
        dtype: str = "float32", **kwargs
    ):
        return EngineCore(
            EngineConfig(
                model=config,
                cache=CacheConfig(
                    block_size=16,
                    kv_cache_memory_bytes=num_blocks * bytes_per_block(config, 16, torch.float32),
                ),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=512
                ),
                device=DeviceConfig(dtype=dtype),
                speculative=speculative,
            ),
            weights,
            tokenizer,
            **kwargs,
        )

    return make
