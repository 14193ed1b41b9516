"""HF checkpoint directories: config mapping, single and sharded safetensors, tokenizer, errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tokenmill.engine.loader.checkpoint import expected_shapes, load_checkpoint
from tokenmill.engine.loader.safetensors import load_safetensors, model_config_from_hf

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def base_config(model_type: str, **overrides: Any) -> dict[str, Any]:
    config = {
        "model_type": model_type,
        "vocab_size": 12,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1024,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    config.update(overrides)
    return config


def random_weights(config: dict[str, Any], tied: bool, bias: bool) -> dict[str, torch.Tensor]:
    parsed = model_config_from_hf(config)
    generator = torch.Generator().manual_seed(0)
    shapes = expected_shapes(parsed)
    assert ("lm_head.weight" in shapes) is not tied
    assert any(name.endswith(".bias") for name in shapes) is bias
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def write_tokenizer(directory: Path, tokenizer_config: dict[str, Any]) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|eot|>": 3, "h": 4, "i": 5, "hi": 6, "Ġ": 7}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[("h", "i")], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>", "<|eot|>")]
    )
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.fixture
def llama_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Untied Llama 3-style checkpoint in one bf16 file, with generation_config eos ids."""
    config = base_config(
        "llama",
        rope_theta=500000.0,
        rope_scaling=LLAMA3_SCALING,
        tie_word_embeddings=False,
        eos_token_id=[2, 3],
    )
    weights = random_weights(config, tied=False, bias=False)
    stored = {name: t.to(torch.bfloat16) for name, t in weights.items()}
    stored["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old exports carry this
    save_file(stored, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    write_tokenizer(
        tmp_path,
        {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "chat_template": "{{ bos_token }}{{ messages[-1]['content'] }}",
        },
    )
    return tmp_path, {
        name: t.to(torch.float32) for name, t in stored.items() if "inv_freq" not in name
    }


@pytest.fixture
def qwen2_dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """Tied Qwen2 checkpoint (q/k/v biases), transformers v5 rope_parameters, two shards."""
    config = base_config(
        "qwen2",
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    weights = random_weights(config, tied=True, bias=True)
    names = sorted(weights)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    # a tied checkpoint that still stores the head: the loader drops it
    shards["model-00002-of-00002.safetensors"].append("lm_head.weight")
    weights_with_head = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}
    for file, members in shards.items():
        save_file({n: weights_with_head[n] for n in members}, str(tmp_path / file))
    index = {"metadata": {}, "weight_map": {n: f for f, members in shards.items() for n in members}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_tokenizer(tmp_path, {"eos_token": {"content": "<|eot|>", "special": True}})
    (tmp_path / "chat_template.jinja").write_text("[{{ messages | length }}]")
    return tmp_path, weights


def test_llama_dir_config_weights_and_tokenizer(
    llama_dir: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, expected = llama_dir
    checkpoint = load_checkpoint(path)
    config = checkpoint.config
    assert config.architecture == "llama"
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (
        12,
        32,
        48,
        2,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
    assert config.rms_norm_eps == 1e-5
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == LLAMA3_SCALING
    assert config.max_position_embeddings == 1024
    assert config.tie_word_embeddings is False
    assert config.attention_bias is False
    assert config.bos_token_id == 1
    assert config.eos_token_ids == (2, 3, 4)

    assert set(checkpoint.weights) == set(expected)
    assert len(expected) == 3 + 2 * 9
    for name, tensor in expected.items():
        assert checkpoint.weights[name].dtype == torch.float32
        assert torch.equal(checkpoint.weights[name], tensor), name
    assert checkpoint.weights["model.layers.1.self_attn.k_proj.weight"].shape == (16, 32)

    tokenizer = checkpoint.tokenizer
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (2, 3, 4)
    assert tokenizer.encode("hi</s>") == [6, 2]
    assert tokenizer.apply_chat_template([{"role": "user", "content": "yo"}]) == "<s>yo"
    assert checkpoint.source == str(path)


def test_qwen2_sharded_with_bias(qwen2_dir: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, expected = qwen2_dir
    config, weights = load_safetensors(path)
    assert config.architecture == "qwen2"
    assert config.attention_bias is True
    assert config.tie_word_embeddings is True
    assert config.rope_theta == 1e6
    assert config.rope_scaling is None
    assert config.eos_token_ids == (2,)
    assert set(weights) == set(expected)
    assert "lm_head.weight" not in weights
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name
    assert weights["model.layers.0.self_attn.q_proj.bias"].shape == (32,)
    assert weights["model.layers.0.self_attn.v_proj.bias"].shape == (16,)

    tokenizer = load_checkpoint(path).tokenizer
    assert tokenizer.eos_token_ids == (3, 2)  # tokenizer_config's eos, then config.json's
    assert tokenizer.apply_chat_template([{"role": "user", "content": "a"}] * 3) == "[3]"


def test_missing_and_mismatched_files_raise(
    qwen2_dir: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = qwen2_dir
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing safetensors shard"):
        load_safetensors(path)
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_checkpoint(path.parent)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_checkpoint(path / "nothing-here")
    (path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not a \.gguf checkpoint"):
        load_checkpoint(path / "weights.bin")


def test_missing_tensor_and_wrong_shape_raise(
    llama_dir: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, expected = llama_dir
    partial = {n: t for n, t in expected.items() if n != "model.norm.weight"}
    save_file(partial, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        load_checkpoint(path)
    save_file({**partial, "model.norm.weight": torch.ones(31)}, str(path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"model.norm.weight has shape \(31,\), config implies \(32,\)"
    ):
        load_checkpoint(path)


def test_config_errors() -> None:
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        model_config_from_hf(base_config("gpt2"))
    config = base_config("mistral")
    del config["hidden_size"]
    with pytest.raises(ValueError, match="missing 'hidden_size'"):
        model_config_from_hf(config)
    mistral = model_config_from_hf(base_config("mistral", head_dim=None, num_key_value_heads=None))
    assert (mistral.head_dim, mistral.num_kv_heads, mistral.attention_bias) == (8, 4, False)
