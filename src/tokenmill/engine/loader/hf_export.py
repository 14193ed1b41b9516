"""Export a loaded checkpoint as an HF transformers directory (the other peers' format).

What tokenmill loaded (a GGUF file is dequantized and its Q/K rows un-permuted on load,
so the tensors already carry transformers' names and layout) is written as:

    config.json              LlamaForCausalLM / Qwen2ForCausalLM, from the ModelConfig
    model.safetensors        every weight in `dtype` (bf16 by default); a tied lm_head is
                             not stored (tie_word_embeddings says so)
    tokenizer.json           the tokenizers backend as tokenmill built it (GGUF vocab ->
                             byte-level BPE, pre-tokenizer, BOS post-processor)
    tokenizer_config.json    PreTrainedTokenizerFast, special tokens, the chat template
    generation_config.json   bos and eos ids

The directory loads back through `load_checkpoint` to the same weights (cast to `dtype`)
and through transformers' `from_pretrained`; vLLM serves it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokenmill.engine.config import ModelConfig
from tokenmill.engine.loader.checkpoint import Checkpoint

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def hf_config(config: ModelConfig, dtype: str) -> dict[str, Any]:
    """config.json for `config`: the fields `model_config_from_hf` reads, plus transformers' defaults."""
    if config.architecture not in _ARCHITECTURES:
        raise ValueError(f"cannot export architecture {config.architecture!r}")
    eos_ids = list(config.eos_token_ids)
    eos: int | list[int] | None = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if config.architecture == "qwen2":
        out["use_sliding_window"] = False
    else:
        out["attention_bias"] = config.attention_bias
        out["mlp_bias"] = False
    return out


def export_hf(checkpoint: Checkpoint, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Write `checkpoint` as an HF directory; returns its path. Existing files are replaced."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = checkpoint.config
    tensors = {
        name: tensor.to(EXPORT_DTYPES[dtype]).contiguous()
        for name, tensor in sorted(checkpoint.weights.items())
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", hf_config(config, dtype))

    tokenizer = checkpoint.tokenizer
    tokenizer.backend.save(str(out / "tokenizer.json"))
    special = dict(tokenizer.chat_template.special_tokens)
    eos_ids = list(tokenizer.eos_token_ids) or list(config.eos_token_ids)
    if "eos_token" not in special and eos_ids:
        special["eos_token"] = tokenizer.id_to_token(eos_ids[0]) or ""
    if "bos_token" not in special and tokenizer.bos_token_id is not None:
        special["bos_token"] = tokenizer.id_to_token(tokenizer.bos_token_id) or ""
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **{key: special[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token") if key in special},
            "chat_template": tokenizer.chat_template.source,
            "model_max_length": config.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        },
    )
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.bos_token_id
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids or None},
    )
    return out


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
