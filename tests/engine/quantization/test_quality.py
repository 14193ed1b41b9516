"""Quality limits of each weight scheme on the default model (bf16 activations):
perplexity on the first 4,096 tokens of the pydoc topics against the unquantized model.

The default model's projections are Q4_1 in its GGUF: the bf16 baseline runs their exact
dequantized values, int4 (groups of 32) takes the same codes over, so it must match the
baseline closely; int8 and fp8 requantize those values."""

from __future__ import annotations

import pytest

from tokenmill import LLM
from tokenmill.engine.quantization.quality import evaluation_text, perplexity

LIMITS = {"int8": 1.02, "fp8": 1.02, "int4": 1.10}
NUM_TOKENS = 4096


@pytest.fixture(scope="module")
def baseline() -> tuple[list[int], float]:
    llm = LLM(dtype="bfloat16", kv_cache_memory_bytes=1 << 24)
    ids = llm.tokenizer.encode(evaluation_text())[:NUM_TOKENS]
    return ids, perplexity(llm.engine.runner.model, ids)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_perplexity_within_limit(baseline, method) -> None:
    ids, base = baseline
    llm = LLM(dtype="bfloat16", quantization=method, kv_cache_memory_bytes=1 << 24)
    ppl = perplexity(llm.engine.runner.model, ids)
    assert 8.0 < base < 20.0  # the model does read this text
    assert ppl <= LIMITS[method] * base, (method, ppl, base)
    if method == "int4":  # the GGUF's own codes: the same weights, other rounding
        assert abs(ppl / base - 1) < 0.01
