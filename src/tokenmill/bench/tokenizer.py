"""The benchmark's tokenizer: which ids random prompts use, and token counts without usage.

A spec is a tokenizer.json file, an HF checkpoint directory, a .gguf file, or a model id
already in tokenmill's store (it is never pulled for a benchmark). Only the tokenizer is
read: a GGUF file's metadata, not its weights.
"""

from __future__ import annotations

from pathlib import Path

from tokenmill.engine.loader.tokenizer import Tokenizer


def load_tokenizer(spec: str) -> Tokenizer:
    path = Path(spec).expanduser()
    if not path.exists():
        from tokenmill.engine.loader.model_store import ModelStore

        stored = ModelStore().get(spec)
        if stored is None:
            raise ValueError(f"tokenizer {spec!r} is neither a path nor a model in the local store")
        path = stored.path
    if path.is_dir():
        from tokenmill.engine.loader.safetensors import HFDirectory

        directory = HFDirectory.open(path)
        return Tokenizer.from_file(
            directory.tokenizer_file,
            directory.tokenizer_config,
            extra_eos_token_ids=directory.generation_eos_token_ids,
            chat_template=directory.chat_template,
        )
    if path.suffix.lower() == ".gguf":
        from tokenmill.engine.loader.gguf import GGUFFile

        return Tokenizer.from_gguf(GGUFFile(path).metadata)
    if path.suffix.lower() == ".json":
        return Tokenizer.from_file(path)
    raise ValueError(f"{path} is not a tokenizer.json, an HF directory or a .gguf file")
