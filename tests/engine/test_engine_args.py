"""EngineArgs refuses bad cache settings before it loads anything."""

from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.engine.engine_args import EngineArgs


@pytest.mark.parametrize("bad", ["fp16", "bfloat16", "FP8", "", "e5m2"])
def test_bad_kv_cache_dtype_is_refused_before_loading(bad: str) -> None:
    # The model does not exist: the error is about the cache dtype, so nothing was loaded.
    args = EngineArgs(model="/nonexistent/model.gguf", kv_cache_dtype=bad)
    with pytest.raises(ValueError, match=f"kv_cache_dtype must be one of auto, fp8, int8, got {bad!r}"):
        args.create_engine()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, int8"):
        LLM("/nonexistent/model.gguf", kv_cache_dtype=bad)


def test_kv_cache_dtype_defaults_to_auto() -> None:
    assert EngineArgs().kv_cache_dtype == "auto"
