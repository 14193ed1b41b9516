"""GGUF checkpoints: metadata, tensor table and dequantized float32 weights under HF names.

A GGUF file is a header, a list of typed key/value metadata, a tensor table
(name, dims, ggml type, offset) and an aligned data section:

    "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv x   [key: str][type u32][value]          str = [len u64][utf-8 bytes]
    n_tensors x [name: str][n_dims u32][dims u64 x n_dims][type u32][offset u64]
    padding to `general.alignment` (32)
    tensor data, each tensor at data_start + offset

`gguf.GGUFReader` builds numpy views for every element of every array, which costs
~1.8 s on the 49k tokens + 49k merges of a tokenizer. The metadata is instead walked
here with `struct.unpack_from` over a memory map (~50 ms); the `gguf` package still
supplies the type enums, the block sizes and the dequantizer for rare quant types.

Weights are dequantized with vectorized torch ops for the common types (Q4_0, Q4_1,
Q8_0, F16, BF16, F32) and renamed to transformers' names. llama.cpp's converter for the
`llama` architecture permutes the rows of Q and K (and their biases) into its rotary
layout; that permutation is undone per head so the tensors equal what transformers'
GGUF loader produces.
"""

from __future__ import annotations

import functools
import mmap
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize as gguf_dequantize

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.quantization.weights import QuantizedWeight, from_gguf_q4, from_gguf_q8

_SUPPORTED_VERSIONS = (2, 3)
_SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Architectures whose llama.cpp converter permutes Q/K rows for its rotary layout.
_PERMUTED_QK_ARCHITECTURES = ("llama",)

# Fixed-width scalar value types: struct format character per GGUFValueType.
_SCALAR_FORMAT = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is stored."""

    name: str
    # Torch order (rows first): ggml lists dims fastest-moving first, so reversed.
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    # Absolute byte offset in the file.
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class GGUFContents:
    """What a GGUF file yields: the model shape, HF-named weights (float32 tensors, or
    QuantizedWeights when int4 blocks are kept), raw metadata."""

    config: ModelConfig
    weights: dict[str, Any]
    metadata: dict[str, Any]


class GGUFFile:
    """A GGUF file's metadata and tensor table over a memory map; tensors read on demand."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            # ACCESS_COPY: a private, writable mapping, so torch.frombuffer can view it
            # without a copy (and without its read-only-buffer warning). Nothing writes it.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if self._map[:4] != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic bytes)")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", self._map, 4)
        if version not in _SUPPORTED_VERSIONS:
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self.metadata, pos = self._read_metadata(24, num_kv)
        table, pos = self._read_tensor_table(pos, num_tensors)
        alignment = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        # The data section starts at the next alignment boundary after the table.
        data_start = (pos + alignment - 1) // alignment * alignment
        self.tensors = {
            name: GGUFTensorInfo(
                name, info.shape, info.ggml_type, data_start + info.offset, info.num_bytes
            )
            for name, info in table.items()
        }

    # ---- header -------------------------------------------------------------------

    def _read_str(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, pos)
        pos += 8
        return self._map[pos : pos + length].decode("utf-8"), pos + length

    def _read_metadata(self, pos: int, count: int) -> tuple[dict[str, Any], int]:
        metadata: dict[str, Any] = {}
        for _ in range(count):
            key, pos = self._read_str(pos)
            (value_type,) = struct.unpack_from("<I", self._map, pos)
            metadata[key], pos = self._read_value(pos + 4, GGUFValueType(value_type))
        return metadata, pos

    def _read_value(self, pos: int, value_type: GGUFValueType) -> tuple[Any, int]:
        if value_type in _SCALAR_FORMAT:
            fmt = "<" + _SCALAR_FORMAT[value_type]
            (value,) = struct.unpack_from(fmt, self._map, pos)
            return value, pos + struct.calcsize(fmt)
        if value_type == GGUFValueType.STRING:
            return self._read_str(pos)
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"{self.path}: unknown metadata value type {value_type}")
        raw_element_type, count = struct.unpack_from("<IQ", self._map, pos)
        pos += 12
        element_type = GGUFValueType(raw_element_type)
        if element_type in _SCALAR_FORMAT:
            # Numeric arrays (token types, scores) in one bulk read.
            fmt = f"<{count}{_SCALAR_FORMAT[element_type]}"
            return list(struct.unpack_from(fmt, self._map, pos)), pos + struct.calcsize(fmt)
        if element_type == GGUFValueType.STRING:
            return self._read_str_array(pos, count)
        # Nested arrays: rare, walk them element by element.
        values = []
        for _ in range(count):
            value, pos = self._read_value(pos, element_type)
            values.append(value)
        return values, pos

    def _read_str_array(self, pos: int, count: int) -> tuple[list[str], int]:
        # Strings are length-prefixed, so the walk is sequential; slicing the map and
        # decoding afterwards keeps the loop body to two cheap calls.
        unpack, data = struct.unpack_from, self._map
        chunks = []
        for _ in range(count):
            (length,) = unpack("<Q", data, pos)
            pos += 8
            chunks.append(data[pos : pos + length])
            pos += length
        return [chunk.decode("utf-8") for chunk in chunks], pos

    def _read_tensor_table(self, pos: int, count: int) -> tuple[dict[str, GGUFTensorInfo], int]:
        # Offsets here are relative to the data section, which starts after the table.
        tensors: dict[str, GGUFTensorInfo] = {}
        for _ in range(count):
            name, pos = self._read_str(pos)
            (num_dims,) = struct.unpack_from("<I", self._map, pos)
            dims = struct.unpack_from(f"<{num_dims}Q", self._map, pos + 4)
            pos += 4 + 8 * num_dims
            raw_type, offset = struct.unpack_from("<IQ", self._map, pos)
            pos += 12
            if name in tensors:
                raise ValueError(f"{self.path}: duplicate tensor {name!r}")
            ggml_type = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            num_bytes = prod(dims) // block_size * type_size
            tensors[name] = GGUFTensorInfo(
                name, tuple(reversed(dims)), ggml_type, offset, num_bytes
            )
        return tensors, pos

    # ---- tensors ------------------------------------------------------------------

    def read_tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`, dequantized to a float32 tensor that owns its memory."""
        info = self.tensors[name]
        if info.offset + info.num_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
        raw = torch.frombuffer(
            self._map, dtype=torch.uint8, count=info.num_bytes, offset=info.offset
        )
        return dequantize(raw, info.ggml_type, info.shape)


    def read_int4(self, name: str) -> QuantizedWeight:
        """A Q4_0 / Q4_1 matrix as int4 group-32 codes, scales and zero points."""
        info = self.tensors[name]
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=info.num_bytes, offset=info.offset)
        with_min = info.ggml_type == GGMLQuantizationType.Q4_1
        blocks = raw.view(-1, 20 if with_min else 18)
        rows, cols = info.shape
        return from_gguf_q4(blocks, with_min, (rows, cols))

    def read_int8(self, name: str) -> QuantizedWeight:
        """A Q8_0 matrix as int8 codes with one scale per row (weights.from_gguf_q8)."""
        info = self.tensors[name]
        raw = torch.frombuffer(self._map, dtype=torch.uint8, count=info.num_bytes, offset=info.offset)
        rows, cols = info.shape
        return from_gguf_q8(raw.view(-1, 34), (rows, cols))


_Q4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})
_PROJECTION_PARTS = (".attn_q.", ".attn_k.", ".attn_v.", ".attn_output.", ".ffn_gate.", ".ffn_up.", ".ffn_down.")


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and any(part in name for part in _PROJECTION_PARTS)


# ---- dequantization -----------------------------------------------------------------
#
# Block layouts (32 values per block, little-endian):
#   Q8_0: [d f16][32 x int8]            x = d * q
#   Q4_0: [d f16][16 bytes]             x = d * (q - 8)
#   Q4_1: [d f16][m f16][16 bytes]      x = d * q + m
# In the 4-bit types byte j holds value j in its low nibble and value j + 16 in its high one.


def dequantize(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Raw uint8 bytes of one tensor -> float32 values of `shape` (a fresh tensor)."""
    kind = GGMLQuantizationType
    if ggml_type == kind.F32:
        values = raw.view(torch.float32).clone()
    elif ggml_type == kind.F16:
        values = raw.view(torch.float16).float()
    elif ggml_type == kind.BF16:
        values = raw.view(torch.bfloat16).float()
    elif ggml_type == kind.Q8_0:
        blocks = raw.view(-1, 34)
        values = blocks[:, 2:].view(torch.int8).float().mul_(_block_half(blocks, 0))
    elif ggml_type == kind.Q4_0:
        blocks = raw.view(-1, 18)
        values = _nibbles(blocks[:, 2:]).sub_(8.0).mul_(_block_half(blocks, 0))
    elif ggml_type == kind.Q4_1:
        blocks = raw.view(-1, 20)
        values = _nibbles(blocks[:, 4:]).mul_(_block_half(blocks, 0)).add_(_block_half(blocks, 2))
    else:
        return _dequantize_with_gguf(raw, ggml_type, shape)
    return values.reshape(shape)


def _block_half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    # one f16 scalar per block: [num_blocks, 1] float32
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    # packed: [num_blocks, 16] uint8 -> [num_blocks, 32] float32 (low nibbles, then high).
    # Unpacking into uint8 first and converting once measured a little faster than
    # writing the nibbles into a float tensor directly.
    nibbles = torch.empty(packed.shape[0], 2, 16, dtype=torch.uint8)
    torch.bitwise_and(packed, 0x0F, out=nibbles[:, 0])
    torch.bitwise_right_shift(packed, 4, out=nibbles[:, 1])
    return nibbles.view(-1, 32).float()


def _dequantize_with_gguf(
    raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    # Rare types (K-quants, IQ*): gguf's numpy reference, slower but complete.
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rows = prod(shape[:-1])
    byte_rows = raw.numpy().reshape(rows, shape[-1] // block_size * type_size)
    values = gguf_dequantize(byte_rows, ggml_type)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


# ---- config and names ---------------------------------------------------------------


def model_config_from_gguf(
    metadata: Mapping[str, Any], tensor_names: frozenset[str]
) -> ModelConfig:
    """The decoder's shape from GGUF metadata (`{arch}.*` keys and the tokenizer ids)."""
    arch = metadata.get("general.architecture")
    if arch not in _SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {_SUPPORTED_ARCHITECTURES})"
        )

    def key(name: str) -> Any:
        try:
            return metadata[f"{arch}.{name}"]
        except KeyError:
            raise ValueError(f"GGUF metadata is missing {arch}.{name}") from None

    hidden = int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    vocab_size = metadata.get(f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(metadata["tokenizer.ggml.tokens"])
    if "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF per-frequency rope factors (rope_freqs.weight) are not supported")
    return ModelConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(metadata.get(f"{arch}.attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(metadata, arch),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=gguf_eos_token_ids(metadata),
        architecture=arch,
    )


def gguf_eos_token_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """eos, then end-of-turn / end-of-message ids when the file declares them."""
    ids: list[int] = []
    for name in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{name}")
        if token_id is not None and token_id not in ids:
            ids.append(int(token_id))
    return tuple(ids)


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> dict | None:
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    scaling: dict[str, Any] = {
        "rope_type": scaling_type,
        "factor": float(metadata[f"{arch}.rope.scaling.factor"]),
    }
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


# GGUF name -> HF name. Layer tensors are `blk.{i}.<leaf>.<weight|bias>`.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_LEAVES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """transformers' name for a GGUF tensor name; ValueError for tensors we do not load."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match is None or match.group(2) not in _LAYER_LEAVES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, leaf, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_LEAVES[leaf]}.{kind}"


def unpermute_qk(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of a Q or K weight (or bias).

    The converter reorders each head's rows from HF's rotate-half layout
    [x0..x(d/2-1), y0..y(d/2-1)] to interleaved pairs [x0, y0, x1, y1, ...]:
        w.reshape(heads, 2, d/2, ...).swapaxes(1, 2)
    so the inverse views each head as [d/2, 2] pairs and swaps them back.
    """
    rows = tensor.shape[0]
    # [heads, d/2, 2, ...] -> [heads, 2, d/2, ...] -> [rows, ...]
    paired = tensor.reshape(num_heads, rows // num_heads // 2, 2, *tensor.shape[1:])
    return paired.transpose(1, 2).reshape(tensor.shape).contiguous()


def load_gguf(path: str | Path, keep_int4: bool = False, keep_int8: bool = False) -> GGUFContents:
    """Read a GGUF file into (ModelConfig, HF-named weights, metadata).

    Weights are float32, except with `keep_int4`: then the decoder projections stored as
    Q4_0 / Q4_1 come as int4 group-32 QuantizedWeights made from their blocks directly
    (no float weight is built); with `keep_int8` those stored as Q8_0 come as int8 ones."""
    gguf_file = GGUFFile(path)
    config = model_config_from_gguf(gguf_file.metadata, frozenset(gguf_file.tensors))
    permuted = gguf_file.metadata["general.architecture"] in _PERMUTED_QK_ARCHITECTURES
    weights: dict[str, Any] = {}
    for name in gguf_file.tensors:
        tensor: Any
        info = gguf_file.tensors[name]
        if keep_int4 and _is_projection(name) and info.ggml_type in _Q4_TYPES:
            tensor = gguf_file.read_int4(name)
        elif keep_int8 and _is_projection(name) and info.ggml_type == GGMLQuantizationType.Q8_0:
            tensor = gguf_file.read_int8(name)
        else:
            tensor = gguf_file.read_tensor(name)
        if permuted and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            if isinstance(tensor, QuantizedWeight):
                tensor = tensor.map_rows(functools.partial(unpermute_qk, num_heads=heads))
            else:
                tensor = unpermute_qk(tensor, heads)
        weights[hf_name(name)] = tensor
    return GGUFContents(config=config, weights=weights, metadata=gguf_file.metadata)
