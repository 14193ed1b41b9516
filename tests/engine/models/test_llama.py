"""Our Llama decoder equals transformers' on tiny random models (cache-free causal pass)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.models.layers.fused import TorchLayerOps, select_layer_ops
from tokenmill.engine.models.llama import LlamaForCausalLM, causal_attention

OPS = {"torch": TorchLayerOps(), "cpu-fused": select_layer_ops(torch.device("cpu"), torch.float32)}

transformers = pytest.importorskip("transformers")


def _pair(arch: str, rope_scaling: dict | None = None, tie: bool = True, ops=None):
    torch.manual_seed(0)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    if arch == "qwen2":
        hf_config = transformers.Qwen2Config(**common)
        hf = transformers.Qwen2ForCausalLM(hf_config)
    else:
        hf_config = transformers.LlamaConfig(**common, rope_scaling=rope_scaling)
        hf = transformers.LlamaForCausalLM(hf_config)
    hf.eval()
    with torch.no_grad():  # random biases instead of zeros, so a dropped bias shows
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    config = ModelConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=rope_scaling,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        attention_bias=arch == "qwen2",
        architecture=arch,
    )
    ours = LlamaForCausalLM(config, max_positions=256, ops=ops)
    ours.load_weights({k: v.detach().clone() for k, v in hf.state_dict().items()})
    return hf, ours


@pytest.mark.parametrize(
    ("arch", "rope_scaling", "tie"),
    [
        ("llama", None, True),
        ("llama", None, False),
        ("qwen2", None, True),
        (
            "llama",
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            True,
        ),
        ("llama", {"rope_type": "linear", "factor": 2.0}, True),
    ],
)
@pytest.mark.parametrize("ops", sorted(OPS))
def test_logits_equal_transformers(arch: str, rope_scaling: dict | None, tie: bool, ops: str) -> None:
    hf, ours = _pair(arch, rope_scaling, tie, OPS[ops])
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        got = ours.compute_logits(ours(ids, torch.arange(40), causal_attention))
    assert got.shape == (40, 97)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_load_weights_rejects_missing_and_unused_tensors() -> None:
    hf, ours = _pair("llama")
    weights = dict(hf.state_dict())
    del weights["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.down_proj\.weight'"):
        ours.load_weights(weights)
    weights = dict(hf.state_dict())
    weights["model.layers.9.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="does not use"):
        ours.load_weights(weights)
