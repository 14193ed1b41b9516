"""tokenmill: a self-hosted LLM inference platform.

`from tokenmill import LLM, SamplingParams` is the offline API. The names load lazily so
that `import tokenmill.cli` (and `tokenmill --help`) does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from tokenmill.engine.llm import LLM
    from tokenmill.engine.outputs import CompletionOutput, RequestOutput
    from tokenmill.engine.request import SamplingParams

_LAZY = {
    "LLM": "tokenmill.engine.llm",
    "CompletionOutput": "tokenmill.engine.outputs",
    "RequestOutput": "tokenmill.engine.outputs",
    "SamplingParams": "tokenmill.engine.request",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
