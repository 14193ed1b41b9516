"""A quantized checkpoint loads back to the very codes written, and runs."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill.engine.loader.checkpoint import Checkpoint, load_checkpoint
from tokenmill.engine.models.registry import build_model
from tokenmill.engine.quantization.apply import quantize_linears
from tokenmill.engine.quantization.checkpoint import save_quantized
from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.quantization.smoothing import calibration_token_ids
from tokenmill.engine.quantization.weights import QuantizedWeight, pack_int4, quantize, unpack_int4


def test_int4_packing_round_trip() -> None:
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (3, 32)
    assert packed[0, 0] == codes[0, 0] | (codes[0, 1] << 4)
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize(("method", "group"), [("int8", 32), ("int4", 32), ("int4", 64), ("fp8", 32)])
def test_save_and_load_quantized(tmp_path, byte_model, method, group) -> None:
    config, weights, tokenizer = byte_model
    checkpoint = Checkpoint(config=config, weights=dict(weights), tokenizer=tokenizer, source="tiny")
    scheme = QuantConfig(method, group)
    out = save_quantized(checkpoint, tmp_path / "q", scheme)
    hf = json.loads((out / "config.json").read_text())
    assert hf["quantization_config"]["quant_method"] == "tokenmill" and hf["quantization_config"]["method"] == method
    loaded = load_checkpoint(out)
    assert loaded.quantization == scheme
    name = "model.layers.1.mlp.down_proj.weight"
    got = loaded.weights[name]
    assert isinstance(got, QuantizedWeight)
    if method == "int8":  # smoothed for int8 activations, calibrated as load-time int8 is
        model = build_model(config, 512)
        model.load_weights(dict(weights))
        quantize_linears(model, scheme, calibration_token_ids(tokenizer))
        assert got.smooth is not None and torch.equal(got.smooth, model.layers[1].down_proj.smooth)
        q, k, v = (loaded.weights[f"model.layers.0.self_attn.{n}_proj.weight"].smooth for n in "qkv")
        assert torch.equal(q, k) and torch.equal(q, v)  # one input, one set of factors
    else:
        assert got.smooth is None
    want = quantize(weights[name], scheme, got.smooth)
    assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scales, want.scales)
    assert torch.equal(loaded.weights["model.norm.weight"], weights["model.norm.weight"].bfloat16().float())
    with pytest.raises(ValueError, match="already"):
        save_quantized(loaded, tmp_path / "again", QuantConfig("int8" if method != "int8" else "fp8"))


def test_foreign_quantization_configs_are_refused(tmp_path, byte_model) -> None:
    config, weights, tokenizer = byte_model
    out = save_quantized(Checkpoint(config, dict(weights), tokenizer, "tiny"), tmp_path / "q", QuantConfig("int8"))
    hf = json.loads((out / "config.json").read_text())
    hf["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (out / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        load_checkpoint(out)


def test_engine_runs_a_quantized_checkpoint_and_refuses_another_scheme(tmp_path, byte_model) -> None:
    from tokenmill import LLM, SamplingParams

    config, weights, tokenizer = byte_model
    out = save_quantized(Checkpoint(config, dict(weights), tokenizer, "tiny"), tmp_path / "q", QuantConfig("int4", 64))
    llm = LLM(str(out), dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256)
    assert llm.engine.config.quantization == QuantConfig("int4", 64)
    result = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0))
    assert len(result[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="holds int4 weights \\(groups of 64\\); it cannot run as int8"):
        LLM(str(out), dtype="float32", quantization="int8", kv_cache_memory_bytes=1 << 22, max_model_len=256)
