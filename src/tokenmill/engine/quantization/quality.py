"""The quality cost of a quantization scheme, measured on text that ships with Python.

Evaluation text: the pydoc topics (`pydoc_data.topics`, the help texts of Python's
keywords and statements) in sorted topic order, tokenized, first `num_tokens` tokens.

    perplexity = exp(mean negative log-likelihood of each token given the ones before it)

scored in non-overlapping windows of `window` tokens (each window starts fresh, its first
token unscored), in float32 logits. `perplexity` runs the model's own forward with no KV
cache (what weight schemes change); `cached_perplexity` asks the engine itself for each
window's prompt logprobs, so the window is prefilled through the paged KV cache in chunks
of the engine's token budget and every chunk attends over K/V written to and read back
from the blocks: with kv_cache_dtype "fp8" or "int8", quantized K/V (what KV schemes
change).
Greedy agreement: on a fixed prompt set, the fraction of generated positions where a
scheme's greedy token equals the reference's, counted up to the first disagreement's end
of sequence (positions after a divergence still count if they match).
"""

from __future__ import annotations

import math

import torch

from tokenmill.engine.core import EngineCore
from tokenmill.engine.models.llama import LlamaForCausalLM, causal_attention
from tokenmill.engine.request import Request, SamplingParams


def evaluation_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[name] for name in sorted(topics))


@torch.inference_mode()
def perplexity(model: LlamaForCausalLM, token_ids: list[int], window: int = 1024) -> float:
    device = next(model.parameters()).device
    total_nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2:
            break
        ids = torch.tensor(chunk, device=device)
        hidden = model(ids, torch.arange(len(chunk), device=device), causal_attention)
        logits = model.compute_logits(hidden[:-1])
        logprobs = torch.log_softmax(logits, dim=-1)
        nll = -logprobs.gather(1, ids[1:, None]).sum()
        total_nll += float(nll)
        count += len(chunk) - 1
    return math.exp(total_nll / count)


def cached_perplexity(engine: EngineCore, token_ids: list[int], window: int = 1024) -> float:
    """perplexity() computed by the engine through its paged KV cache (see the top). The
    engine must be idle; prefix caching must not serve the windows from other runs."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    windows = [token_ids[s : s + window] for s in range(0, len(token_ids) - 1, window)]
    for i, chunk in enumerate(w for w in windows if len(w) >= 2):
        engine.add_request(Request(f"perplexity-{i}", chunk, params))
    total_logprob, count = 0.0, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            for position in output.new_prompt_logprobs or ():
                if position is not None:  # the window's first token is not scored
                    # The prompt token's own logprob comes first.
                    total_logprob += next(iter(position.values())).logprob
                    count += 1
    return math.exp(-total_logprob / count)


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Fraction of positions (over all prompts) where the two greedy outputs agree."""
    same = total = 0
    for ref, cand in zip(reference, candidate, strict=True):
        total += len(ref)
        same += sum(a == b for a, b in zip(ref, cand, strict=False))
    return same / total if total else 1.0
