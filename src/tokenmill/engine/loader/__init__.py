"""Checkpoint loading: GGUF and HF safetensors, tokenizer, chat template, model store.

`load_checkpoint` and `Tokenizer` load lazily, so importing the model store (as the CLI
does) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Checkpoint", "Tokenizer", "load_checkpoint"]

if TYPE_CHECKING:
    from tokenmill.engine.loader.checkpoint import Checkpoint, load_checkpoint
    from tokenmill.engine.loader.tokenizer import Tokenizer

_LAZY = {
    "Checkpoint": "tokenmill.engine.loader.checkpoint",
    "load_checkpoint": "tokenmill.engine.loader.checkpoint",
    "Tokenizer": "tokenmill.engine.loader.tokenizer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill.engine.loader' has no attribute {name!r}")
