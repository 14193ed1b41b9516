"""load_checkpoint on the default GGUF model: config, weights and tokenizer agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.engine.loader import Checkpoint, Tokenizer, load_checkpoint
from tokenmill.engine.loader.checkpoint import expected_shapes
from tokenmill.engine.loader.model_store import resolve_model


def default_gguf() -> Path:
    """The default model's GGUF in the store (`make test` pulls it first)."""
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return load_checkpoint(default_gguf())


@pytest.mark.slow
def test_default_model_checkpoint(checkpoint: Checkpoint) -> None:
    assert checkpoint.source == str(default_gguf())
    shapes = expected_shapes(checkpoint.config)
    assert {n: tuple(t.shape) for n, t in checkpoint.weights.items()} == shapes
    assert all(t.dtype == torch.float32 for t in checkpoint.weights.values())
    assert shapes["model.layers.29.self_attn.k_proj.weight"] == (192, 576)

    tokenizer = checkpoint.tokenizer
    assert isinstance(tokenizer, Tokenizer)
    assert tokenizer.vocab_size == checkpoint.config.vocab_size
    assert tokenizer.eos_token_ids == checkpoint.config.eos_token_ids == (2,)
    assert tokenizer.bos_token_id == checkpoint.config.bos_token_id == 1
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.encode(prompt)[:1] == [1]
