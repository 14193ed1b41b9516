"""HF checkpoint directories: config.json + safetensors (single file or sharded) + tokenizer.

Reads Llama, Mistral and Qwen2 checkpoints into the same (ModelConfig, float32 weights
under HF names) pair the GGUF loader yields. config.json fields map one to one; the
differences between the families are few:

  * Qwen2 always has q/k/v biases (its config has no `attention_bias` key);
  * transformers v5 writes `rope_parameters` (rope_theta + scaling) where v4 wrote
    `rope_theta` and `rope_scaling`; both are read, and a llama3 scaling dict is carried
    through as is;
  * eos may be an int or a list, and generation_config.json may add more eos ids.

Tensors are read shard by shard (`model.safetensors.index.json` names the shards) and
converted to float32. A tied checkpoint that still stores `lm_head.weight` has it
dropped, and the derived `rotary_emb.inv_freq` buffers of old exports are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.quantization.weights import QuantizedWeight, unpack_int4

_ARCHITECTURES = ("llama", "mistral", "qwen2")
_INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class HFDirectory:
    """The parsed JSON files of an HF checkpoint directory."""

    path: Path
    config: dict[str, Any]
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> HFDirectory:
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json (not an HF checkpoint directory)")
        return cls(
            path=path,
            config=read_json(path / "config.json"),
            tokenizer_config=read_json(path / "tokenizer_config.json", missing_ok=True),
            generation_config=read_json(path / "generation_config.json", missing_ok=True),
        )

    @property
    def tokenizer_file(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def chat_template(self) -> str | None:
        """A chat_template.jinja file, which newer exports write instead of the config key."""
        template_file = self.path / "chat_template.jinja"
        return template_file.read_text(encoding="utf-8") if template_file.is_file() else None

    @property
    def generation_eos_token_ids(self) -> tuple[int, ...]:
        return _id_list(self.generation_config.get("eos_token_id"))


def read_json(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    """A JSON object file ({} when absent and `missing_ok`), with errors naming the file."""
    if not path.is_file():
        if missing_ok:
            return {}
        raise FileNotFoundError(f"missing {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def model_config_from_hf(
    config: dict[str, Any], generation_config: dict[str, Any] | None = None
) -> ModelConfig:
    """ModelConfig from config.json (+ generation_config.json for extra eos ids)."""
    arch = config.get("model_type")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"model_type {arch!r} is not supported (supported: {_ARCHITECTURES})")

    def required(name: str) -> Any:
        if config.get(name) is None:
            raise ValueError(f"config.json is missing {name!r}")
        return config[name]

    hidden = int(required("hidden_size"))
    num_heads = int(required("num_attention_heads"))
    rope = dict(config.get("rope_parameters") or {})
    rope_theta = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_scaling = config.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    eos_ids = _id_list(config.get("eos_token_id")) + _id_list(
        (generation_config or {}).get("eos_token_id")
    )
    return ModelConfig(
        vocab_size=int(required("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(required("intermediate_size")),
        num_layers=int(required("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=dict(rope_scaling) if rope_scaling else None,
        max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
        # transformers' default for all three families is untied.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "qwen2" else bool(config.get("attention_bias", False)),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        architecture=arch,
    )


def safetensors_files(path: Path) -> list[Path]:
    """The shard files: from the index when present, else every *.safetensors file."""
    index = path / _INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [path / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors files")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"missing safetensors shard {file}")
    return files


def load_safetensors_weights(
    path: Path, config: ModelConfig, quantization: QuantConfig | None = None
) -> dict[str, Any]:
    """Every tensor of the checkpoint as float32, keyed by its HF name. In a checkpoint
    quantized by tokenmill (`quantization` from its config.json), a weight stored as
    `NAME.qweight` + `NAME.scales` (+ `NAME.zeros`) comes back as one QuantizedWeight."""
    weights: dict[str, Any] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # derived from rope_theta; rebuilt by the model
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # a tied head is the embedding
                base, _, suffix = name.rpartition(".")
                if quantization is not None and suffix in QUANTIZED_PARTS:
                    parts.setdefault(base + ".weight", {})[suffix] = shard.get_tensor(name)
                    continue
                if name in weights:
                    raise ValueError(f"tensor {name!r} appears in more than one shard")
                weights[name] = shard.get_tensor(name).to(torch.float32)
    for name, tensors in parts.items():
        assert quantization is not None
        weights[name] = _quantized_weight(name, tensors, quantization)
    return weights


# A tokenmill-quantized weight NAME.weight is stored as these tensors.
QUANTIZED_PARTS = ("qweight", "scales", "zeros", "smooth")


def quantization_from_hf(config: dict[str, Any]) -> QuantConfig | None:
    """The scheme of a checkpoint tokenmill quantized (`quantization_config` in
    config.json); other quantization formats are refused, never read as floats."""
    spec = config.get("quantization_config")
    if not spec:
        return None
    if spec.get("quant_method") != "tokenmill":
        raise ValueError(
            f"quantization_config.quant_method {spec.get('quant_method')!r} is not supported "
            "(tokenmill reads checkpoints written by `tokenmill models quantize`)"
        )
    return QuantConfig(str(spec.get("method")), int(spec.get("group_size", 32)))


def _quantized_weight(name: str, tensors: dict[str, torch.Tensor], scheme: QuantConfig) -> QuantizedWeight:
    needed = {"qweight", "scales", *(("zeros",) if scheme.method == "int4" else ())}
    if set(tensors) - {"smooth"} != needed or ("smooth" in tensors and scheme.method != "int8"):
        raise ValueError(f"quantized weight {name!r} has parts {sorted(tensors)}, {scheme.method} needs {sorted(needed)}")
    zeros = tensors.get("zeros")
    codes = tensors["qweight"]
    if scheme.method == "int4":  # two codes a byte on disk
        codes = unpack_int4(codes)
    return QuantizedWeight(
        scheme.method,
        codes,
        tensors["scales"].float(),
        None if zeros is None else zeros.float(),
        scheme.group_size if scheme.method == "int4" else 0,
        None if "smooth" not in tensors else tensors["smooth"].float(),
    )


def load_safetensors(path: str | Path) -> tuple[ModelConfig, dict[str, Any]]:
    """An HF checkpoint directory -> (ModelConfig, HF-named weights)."""
    directory = HFDirectory.open(path)
    config = model_config_from_hf(directory.config, directory.generation_config)
    return config, load_safetensors_weights(directory.path, config, quantization_from_hf(directory.config))


def _id_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
