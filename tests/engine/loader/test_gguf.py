"""GGUF loading: header parse, dequantization, Q/K unpermute, names, config; the real model vs transformers."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tokenmill.engine.loader.gguf import GGUFContents, GGUFFile, dequantize, load_gguf, unpermute_qk
from tokenmill.engine.loader.model_store import resolve_model


def default_gguf() -> Path:
    """The default model's GGUF in the store (`make test` pulls it first)."""
    return resolve_model("smollm2-135m-instruct")

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 64, 96, 4, 2, 16, 2
TOKENS = [
    "<|endoftext|>",
    "<|im_end|>",
    *[chr(c) for c in range(ord("a"), ord("z") + 1)],
    "he",
    "hel",
]
MERGES = ["h e", "he l"]


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out independently of the loader.
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_tiny_gguf(path: Path, arch: str, projections: Q | None = None) -> dict[str, np.ndarray]:
    """A 2-layer model with one tensor per storage type (or every projection stored as
    `projections`); returns the float values the loader must produce."""
    rng = np.random.default_rng(0)
    vocab = len(TOKENS)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(4.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3] + [1] * (vocab - 2))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_eot_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.add_array("test.floats", [0.5, -1.25])

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, values: np.ndarray, qtype: Q) -> None:
        if projections is not None and any(p in gguf_name for p in (".attn_", ".ffn_gate", ".ffn_up", ".ffn_down")):
            qtype = projections
        if qtype == Q.F32:
            writer.add_tensor(gguf_name, values)
            expected[hf_name] = values
            return
        packed = gguf_quantize(values, qtype)
        writer.add_tensor(gguf_name, packed, raw_shape=packed.shape, raw_dtype=qtype)
        expected[hf_name] = gguf_dequantize(packed, qtype).reshape(values.shape)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", rand(vocab, HIDDEN), Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", rand(HIDDEN), Q.F32)
    permute = arch == "llama"
    if arch == "qwen2":
        add("output.weight", "lm_head.weight", rand(vocab, HIDDEN), Q.F16)
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", hf + "input_layernorm.weight", rand(HIDDEN), Q.F32)
        add(f"blk.{i}.ffn_norm.weight", hf + "post_attention_layernorm.weight", rand(HIDDEN), Q.F32)
        # Q and K are stored as F32 in llama.cpp's permuted order: the loader must give back
        # exactly the HF-layout matrices.
        q, k = rand(HEADS * HEAD_DIM, HIDDEN), rand(KV_HEADS * HEAD_DIM, HIDDEN)
        if projections is None:
            writer.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(q, HEADS) if permute else q)
            writer.add_tensor(
                f"blk.{i}.attn_k.weight", llama_cpp_permute(k, KV_HEADS) if permute else k
            )
            expected[hf + "self_attn.q_proj.weight"] = q
            expected[hf + "self_attn.k_proj.weight"] = k
        else:  # blocks run along rows: permuting rows commutes with (de)quantizing them
            for name, values, heads in (("q", q, HEADS), ("k", k, KV_HEADS)):
                add(f"blk.{i}.attn_{name}.weight", hf + f"self_attn.{name}_proj.weight",
                    llama_cpp_permute(values, heads) if permute else values, projections)
                if permute:
                    expected[hf + f"self_attn.{name}_proj.weight"] = unpermute_qk(
                        torch.from_numpy(np.ascontiguousarray(expected[hf + f"self_attn.{name}_proj.weight"])), heads
                    ).numpy()
        add(
            f"blk.{i}.attn_v.weight",
            hf + "self_attn.v_proj.weight",
            rand(KV_HEADS * HEAD_DIM, HIDDEN),
            Q.BF16,
        )
        add(
            f"blk.{i}.attn_output.weight",
            hf + "self_attn.o_proj.weight",
            rand(HIDDEN, HIDDEN),
            Q.Q4_1,
        )
        add(f"blk.{i}.ffn_gate.weight", hf + "mlp.gate_proj.weight", rand(FFN, HIDDEN), Q.Q4_0)
        # Q5_0 has no fast path: it exercises the gguf numpy fallback.
        add(f"blk.{i}.ffn_up.weight", hf + "mlp.up_proj.weight", rand(FFN, HIDDEN), Q.Q5_0)
        add(f"blk.{i}.ffn_down.weight", hf + "mlp.down_proj.weight", rand(HIDDEN, FFN), Q.F16)
        if arch == "qwen2":
            for name, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                add(
                    f"blk.{i}.attn_{name}.bias",
                    hf + f"self_attn.{name}_proj.bias",
                    rand(rows * HEAD_DIM),
                    Q.F32,
                )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_gguf_weights_config_and_names(tmp_path: Path, arch: str) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, arch)
    contents = load_gguf(path)

    assert set(contents.weights) == set(expected)
    for name, values in expected.items():
        got = contents.weights[name]
        assert got.dtype == torch.float32, name
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))), (
            name
        )

    config = contents.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (
        len(TOKENS),
        HIDDEN,
        FFN,
    )
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        LAYERS,
        4,
        2,
        16,
    )
    assert config.rms_norm_eps == float(np.float32(1e-6))
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert config.max_position_embeddings == 256
    assert config.tie_word_embeddings is (arch == "llama")
    assert config.attention_bias is (arch == "qwen2")
    assert config.bos_token_id == 0
    assert config.eos_token_ids == (1,)
    assert config.architecture == arch


def test_q8_0_projections_kept_as_int8(tmp_path: Path) -> None:
    from tokenmill import LLM, SamplingParams
    from tokenmill.engine.quantization.linear import QuantizedLinear
    from tokenmill.engine.quantization.weights import QuantizedWeight

    path = tmp_path / "q8.gguf"
    expected = write_tiny_gguf(path, "llama", projections=Q.Q8_0)
    kept = load_gguf(path, keep_int8=True).weights
    floats = load_gguf(path).weights
    for i in range(LAYERS):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            key = f"model.layers.{i}.{name}.weight"
            weight = kept[key]
            assert isinstance(weight, QuantizedWeight) and weight.method == "int8", key
            want = torch.from_numpy(np.ascontiguousarray(expected[key]))
            assert torch.equal(floats[key], want)
            # each code within half a step of its row's scale of the stored value
            assert ((weight.dequantize() - want).abs() <= 0.5 * weight.scales[:, None] + 1e-6).all(), key
    assert not isinstance(kept["model.embed_tokens.weight"], QuantizedWeight)  # not a projection
    llm = LLM(str(path), dtype="float32", quantization="int8", kv_cache_memory_bytes=1 << 22, max_model_len=128)
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.qkv_proj, QuantizedLinear) and layer.qkv_proj.smooth is None  # codes kept, weight-only
    out = llm.generate([{"prompt_token_ids": [2, 3, 4]}], SamplingParams(max_tokens=3, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 3


def test_metadata_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "llama")
    ours = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    reference = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == reference
    assert ours.metadata["tokenizer.ggml.tokens"] == TOKENS
    assert ours.metadata["test.floats"] == [0.5, -1.25]
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.ggml_type == tensor.tensor_type
        assert info.shape == tuple(reversed(tensor.shape.tolist()))
        assert info.offset == tensor.data_offset
        assert info.num_bytes == tensor.n_bytes


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.F32, Q.Q5_1])
def test_dequantize_matches_gguf_reference(qtype: Q) -> None:
    values = np.random.default_rng(1).standard_normal((6, 128)).astype(np.float32) * 3
    packed = values if qtype == Q.F32 else gguf_quantize(values, qtype)
    reference = values if qtype == Q.F32 else gguf_dequantize(packed, qtype)
    raw = torch.from_numpy(np.ascontiguousarray(packed).view(np.uint8).reshape(-1).copy())
    got = dequantize(raw, qtype, (6, 128))
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(reference.astype(np.float32)))


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)  # 3 heads of dim 4
    permuted = torch.from_numpy(llama_cpp_permute(weight, 3).copy())
    # head 0 rows in llama.cpp order: x0, y0, x1, y1 = rows 0, 2, 1, 3
    assert permuted[:4, 0].tolist() == [0.0, 6.0, 3.0, 9.0]
    assert torch.equal(unpermute_qk(permuted, 3), torch.from_numpy(weight))
    bias = torch.arange(8.0)
    assert unpermute_qk(bias, 2).tolist() == [0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"NOPE" + bytes(28))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)


# ---- the default model vs transformers' GGUF loader (slow) ----------------------------


@pytest.fixture(scope="module")
def hf_model() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(default_gguf().parent), gguf_file=default_gguf().name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def default_contents() -> GGUFContents:
    return load_gguf(default_gguf())


@pytest.mark.slow
def test_default_model_weights_equal_transformers(
    hf_model: torch.nn.Module, default_contents: GGUFContents
) -> None:
    contents = default_contents
    reference = hf_model.state_dict()
    # transformers keeps the tied head as its own (shared) entry.
    assert contents.config.tie_word_embeddings
    assert set(contents.weights) == set(reference) - {"lm_head.weight"}
    assert len(contents.weights) == 272
    for name, tensor in contents.weights.items():
        assert tensor.dtype == torch.float32
        # exact: max abs diff 0.0 (reported only on failure)
        assert torch.equal(tensor, reference[name]), (name, (tensor - reference[name]).abs().max())


@pytest.mark.slow
def test_default_model_config_equals_transformers(
    hf_model: torch.nn.Module, default_contents: GGUFContents
) -> None:
    config = default_contents.config
    hf = hf_model.config
    assert config.vocab_size == hf.vocab_size == 49152
    assert config.hidden_size == hf.hidden_size == 576
    assert config.intermediate_size == hf.intermediate_size == 1536
    assert config.num_layers == hf.num_hidden_layers == 30
    assert config.num_heads == hf.num_attention_heads == 9
    assert config.num_kv_heads == hf.num_key_value_heads == 3
    assert config.head_dim == hf.head_dim == 64
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert config.rope_scaling is None and hf.rope_parameters["rope_type"] == "default"
    assert config.max_position_embeddings == hf.max_position_embeddings == 8192
    assert config.tie_word_embeddings is hf.tie_word_embeddings is True
    assert config.attention_bias is hf.attention_bias is False
    assert config.bos_token_id == hf.bos_token_id == 1
    assert config.eos_token_ids == (hf.eos_token_id,) == (2,)
