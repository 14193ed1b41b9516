"""export_hf: the written directory loads back to the same weights, in tokenmill and transformers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import tokenizers
import torch
from tokenizers import models, pre_tokenizers

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.loader.chat_template import ChatTemplate
from tokenmill.engine.loader.checkpoint import Checkpoint, load_checkpoint
from tokenmill.engine.loader.hf_export import export_hf, hf_config
from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.models.llama import LlamaForCausalLM, causal_attention


def word_tokenizer(vocab_size: int) -> Tokenizer:
    """`<unk>` 0, `<s>` 1, `</s>` 2, then words w3 ... w{vocab_size - 1}."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return Tokenizer(backend, ChatTemplate.chatml(special), bos_token_id=1, eos_token_ids=[2])


def tiny_checkpoint(config: ModelConfig, weights: dict[str, torch.Tensor], tie: bool) -> Checkpoint:
    config = dataclasses.replace(config, tie_word_embeddings=tie, bos_token_id=1, eos_token_ids=(2,))
    weights = dict(weights)
    if not tie:
        weights["lm_head.weight"] = torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(5))
    return Checkpoint(config, weights, word_tokenizer(config.vocab_size), source="memory")


@pytest.mark.parametrize("tie", [True, False])
def test_float32_export_loads_back_identically(
    tmp_path: Path, tiny_config: ModelConfig, tiny_model_weights: dict[str, torch.Tensor], tie: bool
) -> None:
    original = tiny_checkpoint(tiny_config, tiny_model_weights, tie)
    export_hf(original, tmp_path, dtype="float32")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]
    loaded = load_checkpoint(tmp_path)
    assert loaded.config == dataclasses.replace(original.config, rms_norm_eps=loaded.config.rms_norm_eps)
    assert loaded.config.rms_norm_eps == pytest.approx(original.config.rms_norm_eps)
    assert loaded.weights.keys() == original.weights.keys()
    for name, tensor in original.weights.items():
        assert torch.equal(loaded.weights[name], tensor), name
    text = "w3 w9 nope w127"
    assert loaded.tokenizer.encode(text) == original.tokenizer.encode(text) == [3, 9, 0, 127]
    assert loaded.tokenizer.eos_token_ids == (2,) and loaded.tokenizer.bos_token_id == 1
    messages = [{"role": "user", "content": "w5"}]
    assert loaded.tokenizer.apply_chat_template(messages) == original.tokenizer.apply_chat_template(messages)
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<s>" and tokenizer_config["eos_token"] == "</s>"
    assert tokenizer_config["chat_template"] == original.tokenizer.chat_template.source
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"bos_token_id": 1, "eos_token_id": 2}


def test_bf16_export_is_the_bf16_cast(
    tmp_path: Path, tiny_config: ModelConfig, tiny_model_weights: dict[str, torch.Tensor]
) -> None:
    original = tiny_checkpoint(tiny_config, tiny_model_weights, tie=True)
    export_hf(original, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded = load_checkpoint(tmp_path)
    for name, tensor in original.weights.items():
        assert torch.equal(loaded.weights[name], tensor.to(torch.bfloat16).float()), name
    with pytest.raises(ValueError, match="dtype must be one of"):
        export_hf(original, tmp_path, dtype="int8")


@pytest.mark.parametrize("tie", [True, False])
def test_transformers_loads_the_export_with_the_same_logits(
    tmp_path: Path, tiny_config: ModelConfig, tiny_model_weights: dict[str, torch.Tensor], tie: bool
) -> None:
    transformers = pytest.importorskip("transformers")
    original = tiny_checkpoint(tiny_config, tiny_model_weights, tie)
    export_hf(original, tmp_path, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForCausalLM"
    ours = LlamaForCausalLM(original.config, max_positions=64)
    ours.load_weights(dict(original.weights))
    ids = torch.randint(3, tiny_config.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours.compute_logits(ours(ids, torch.arange(24), causal_attention))
        got = hf(ids[None]).logits[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf_tokenizer("w3 w4 w100", add_special_tokens=False).input_ids == [3, 4, 100]
    assert hf_tokenizer.eos_token == "</s>"


def test_hf_config_fields(tiny_config: ModelConfig) -> None:
    qwen = dataclasses.replace(tiny_config, architecture="qwen2", attention_bias=True, eos_token_ids=(2, 3))
    config = hf_config(qwen, "float16")
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["eos_token_id"] == [2, 3]
    assert "attention_bias" not in config  # Qwen2 always has q/k/v biases
    with pytest.raises(ValueError, match="cannot export"):
        hf_config(dataclasses.replace(tiny_config, architecture="gpt2"), "float32")


@pytest.mark.slow
def test_default_model_export_round_trip(tmp_path: Path) -> None:
    from tokenmill.engine.loader.model_store import resolve_model

    gguf = load_checkpoint(resolve_model("smollm2-135m-instruct"))
    export_hf(gguf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    hf = load_checkpoint(tmp_path)
    assert hf.config == dataclasses.replace(gguf.config, rms_norm_eps=hf.config.rms_norm_eps)
    assert hf.weights.keys() == gguf.weights.keys()
    for name, tensor in gguf.weights.items():
        assert torch.equal(hf.weights[name], tensor.to(torch.bfloat16).float()), name
    prompt = gguf.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}])
    assert hf.tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}]) == prompt
    assert hf.tokenizer.encode(prompt) == gguf.tokenizer.encode(prompt)
    assert hf.tokenizer.eos_token_ids == gguf.tokenizer.eos_token_ids
