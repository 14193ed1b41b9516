"""Parameter counts of known configs, checked against their published sizes by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.plan.model import KNOWN_MODELS, DecoderConfig, ModelShape, resolve_model


def test_llama_3_8b_parameter_count_by_hand() -> None:
    # embeddings + untied head: 2 x 128256 x 4096 = 1,050,673,152
    # per layer: q 4096*4096 + k,v 2*4096*1024 + o 4096*4096 + mlp 3*4096*14336 + norms 2*4096
    #          = 16,777,216 + 8,388,608 + 16,777,216 + 176,160,768 + 8,192 = 218,112,000
    # total: 1,050,673,152 + 32 x 218,112,000 + 4,096 (final norm) = 8,030,261,248
    assert KNOWN_MODELS["llama-3-8b"].num_params == 8_030_261_248


def test_other_known_counts() -> None:
    assert KNOWN_MODELS["llama-3-70b"].num_params == 70_553_706_496
    # tied: 49152*576 + 30 x (331,776 + 221,184 + 331,776 + 2,654,208 + 1,152) + 576
    assert KNOWN_MODELS["smollm2-135m-instruct"].num_params == 134_515_008
    # Qwen2 carries q/k/v biases: 28*128 + 2*4*128 = 4,608 per layer
    assert KNOWN_MODELS["qwen2.5-7b"].num_params == 7_615_616_512


def test_resolve_by_id_alias_and_config_json(tmp_path: Path) -> None:
    shape = resolve_model("llama-3-8b")
    assert shape == ModelShape("llama-3-8b", 8_030_261_248, 32, 8, 128)
    assert resolve_model("meta-llama/Meta-Llama-3-8B-Instruct") == shape
    config = {
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_dir = resolve_model(str(tmp_path))
    assert from_dir.num_params == 134_515_008 and from_dir.head_dim == 64  # 576 / 9
    assert resolve_model(str(tmp_path / "config.json")).num_params == 134_515_008
    # no num_key_value_heads: multi-head attention
    assert DecoderConfig.from_hf({**config, "num_key_value_heads": None}).num_kv_heads == 9


def test_resolve_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not a config\.json path nor a known id"):
        resolve_model("gpt-17")
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="missing 'hidden_size'"):
        DecoderConfig.from_hf({"vocab_size": 3})
    with pytest.raises(ValueError, match="num_layers"):
        ModelShape("x", 10, 0, 1, 1)
