"""API request -> SamplingParams, and the max_tokens rules.

max_tokens: chat defaults to whatever room the context leaves (max_model_len minus the
prompt, OpenAI's semantics); completions default to 16 (the legacy API's default). A
prompt that fills the context, or prompt + max_tokens beyond it, is a 400.
"""

from __future__ import annotations

from tokenmill.engine.logits.processor import LogitsProcessorSpec
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.structured_output.spec import StructuredOutputsParams
from tokenmill.server.errors import invalid
from tokenmill.server.protocol import SamplingFields


def resolve_max_tokens(
    prompt_len: int,
    requested: int | None,
    max_model_len: int,
    *,
    param: str,
    prompt_param: str,
) -> int:
    """The max_tokens to run with; `requested` None means 'fill the context'."""
    if prompt_len >= max_model_len:
        raise invalid(
            f"The prompt is {prompt_len} tokens, which leaves no room in this model's "
            f"context of {max_model_len} tokens",
            prompt_param,
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise invalid(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion). Reduce the prompt or '{param}'",
            param,
        )
    return requested


def build_sampling_params(
    body: SamplingFields,
    *,
    max_tokens: int,
    vocab_size: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
    logits_processors: list[LogitsProcessorSpec] | None = None,
) -> SamplingParams:
    """Every honored field goes through; SamplingParams' own checks become 400s.

    A constraint refuses stop sequences: one could cut the constrained output mid-structure
    and report it as a clean "stop".
    """
    if structured_outputs is not None:
        for name in ("stop", "stop_token_ids"):
            if getattr(body, name):
                raise invalid(
                    f"'{name}' cannot be combined with a structured output or a forced tool call "
                    "(a stop sequence could cut the constrained output mid-structure)",
                    name,
                )
    logit_bias = _logit_bias(body.logit_bias, vocab_size)
    if body.min_tokens > max_tokens:
        raise invalid(f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens})", "min_tokens")
    for token_id in body.stop_token_ids or []:
        if token_id >= vocab_size:
            raise invalid(f"stop_token_ids holds {token_id}, outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    if any(not s for s in body.stop_list):
        raise invalid("stop strings must be non-empty", "stop")
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            seed=body.seed,
            stop=body.stop_list,
            stop_token_ids=list(body.stop_token_ids or []),
            include_stop_str_in_output=body.include_stop_str_in_output,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias,
            skip_special_tokens=body.skip_special_tokens,
            structured_outputs=structured_outputs,
            logits_processors=list(logits_processors or []),
        )
    except ValueError as exc:
        # SamplingParams' messages start with the field name ("top_k must be ...").
        name = str(exc).split(" ", 1)[0]
        raise invalid(str(exc), name if name in SamplingFields.model_fields else None) from None


def _logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """JSON object keys are strings; each must be a token id of this vocabulary."""
    if not raw:
        return None
    bias = {}
    for key, value in raw.items():
        if not key.isdigit() or int(key) >= vocab_size:
            raise invalid(f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", "logit_bias")
        bias[int(key)] = value
    return bias
