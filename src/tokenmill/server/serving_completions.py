"""POST /v1/completions (the legacy text-completion API).

`prompt` may be a string, a list of strings, a list of token ids or a list of token-id
lists; each prompt is one engine request with `n` samples, and choice `i * n + j` is
sample j of prompt i. `echo` puts the prompt in front of each choice's text (and, with
`logprobs`, its prompt-token logprobs in front of the generated ones; the first prompt
token has none). Streamed chunks carry each choice's new text, with `finish_reason` on
the choice's last chunk. `response_format`, `structured_outputs` and
`logits_processors` work as in chat; a constraint applies to the generated text (not to
an echoed prompt).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import JsonValue

from tokenmill.server.constraints import logits_processor_specs, output_constraint, prepare_engine
from tokenmill.server.disconnect import unless_disconnected
from tokenmill.server.errors import invalid
from tokenmill.server.generation import Generation
from tokenmill.server.logprobs import LogprobFormatter
from tokenmill.server.protocol import CompletionRequest, parse_request
from tokenmill.server.responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
)
from tokenmill.server.sampling import build_sampling_params, resolve_max_tokens
from tokenmill.server.sse import DONE, SSEResponse, error_event, sse_event
from tokenmill.server.state import get_state

if TYPE_CHECKING:
    from tokenmill.engine.loader.tokenizer import Tokenizer
    from tokenmill.engine.outputs import PositionLogprobs

LEGACY_DEFAULT_MAX_TOKENS = 16


@dataclass
class Prompt:
    token_ids: list[int]
    # What `echo` returns: the text as sent, or the decoded ids.
    text: str


def parse_prompts(
    raw: JsonValue, tokenizer: Tokenizer, vocab_size: int, *, add_special_tokens: bool, param: str = "prompt"
) -> list[Prompt]:
    """str | list[str] | list[int] | list[list[int]] -> prompts; anything else is a 400."""
    if isinstance(raw, str):
        items: list[JsonValue] = [raw]
    elif isinstance(raw, list) and raw and all(_is_token_id(t) for t in raw):
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise invalid(f"'{param}' must be a non-empty string, list of strings, or token-id list(s)", param)
    prompts = []
    for i, item in enumerate(items):
        where = param if len(items) == 1 else f"{param}[{i}]"
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=add_special_tokens)
            prompts.append(Prompt(ids, item))
        elif isinstance(item, list) and all(_is_token_id(t) for t in item):
            ids = [int(t) for t in item if isinstance(t, int)]
            if any(t >= vocab_size for t in ids):
                raise invalid(f"token ids must be in [0, {vocab_size})", where)
            prompts.append(Prompt(ids, tokenizer.decode(ids, skip_special_tokens=False)))
        else:
            raise invalid(f"'{where}' must be a string or a list of token ids", where)
        if not prompts[-1].token_ids:
            raise invalid(f"'{where}' must not be empty", where)
    return prompts


def _is_token_id(value: JsonValue) -> bool:
    return type(value) is int and value >= 0


async def create_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_request(request, CompletionRequest)
    state.check_model(body.model)
    engine = state.ready_engine()
    vocab_size = engine.model_config.vocab_size
    prompts = parse_prompts(body.prompt, engine.tokenizer, vocab_size, add_special_tokens=body.add_special_tokens)
    requested = LEGACY_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    for prompt in prompts:
        resolve_max_tokens(
            len(prompt.token_ids), requested, engine.max_model_len, param="max_tokens", prompt_param="prompt"
        )
    num_top = body.logprobs
    constraint = output_constraint(body)
    params = build_sampling_params(
        body,
        max_tokens=requested,
        vocab_size=vocab_size,
        logprobs=num_top,
        prompt_logprobs=num_top if body.echo and num_top is not None else None,
        structured_outputs=None if constraint is None else constraint.params,
        logits_processors=logits_processor_specs(body),
    )
    await prepare_engine(engine, params, body)
    generation = Generation(
        state,
        engine,
        [p.token_ids for p in prompts],
        params,
        priority=body.priority,
        cache_salt=body.cache_salt,
        constraint=constraint,
    )
    base = CompletionResponse(
        id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.settings.served_model_name, choices=[]
    )
    formatter = LogprobFormatter(engine.tokenizer, body.skip_special_tokens)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _stream(generation, prompts, base, formatter, body.echo, num_top, include_usage)
        return SSEResponse(events, on_close=generation.close)

    result = await unless_disconnected(request, generation.collect())
    choices = []
    for choice in result.choices:
        prompt = prompts[choice.prompt_index]
        echo_text = prompt.text if body.echo else ""
        logprobs = None
        if num_top is not None:
            logprobs = _logprobs(
                formatter,
                prompt.token_ids if body.echo else [],
                result.prompts[choice.prompt_index].prompt_logprobs if body.echo else None,
                choice.token_ids,
                choice.logprobs,
                num_top,
                len(echo_text),
            )
        choices.append(
            CompletionChoice(
                index=choice.index, text=echo_text + choice.text, logprobs=logprobs, finish_reason=choice.finish_reason
            )
        )
    response = base.model_copy(
        update={
            "choices": choices,
            "usage": Usage.of(result.num_prompt_tokens, result.num_completion_tokens, result.num_cached_tokens),
        }
    )
    return JSONResponse(response.model_dump(mode="json"))


def _logprobs(
    formatter: LogprobFormatter,
    prompt_ids: list[int],
    prompt_positions: list[PositionLogprobs | None] | None,
    token_ids: list[int],
    positions: list[PositionLogprobs],
    num_top: int,
    generated_offset: int,
) -> CompletionLogprobs:
    """Echoed prompt tokens (offsets from 0), then generated ones (from `generated_offset`)."""
    if not prompt_ids:
        return formatter.completion(token_ids, positions, num_top, generated_offset)
    if prompt_positions is None or len(prompt_positions) != len(prompt_ids):
        prompt_positions = [None] * len(prompt_ids)
    head = formatter.completion(prompt_ids, prompt_positions, num_top, 0, generated=False)
    tail = formatter.completion(token_ids, positions, num_top, generated_offset)
    return CompletionLogprobs(
        tokens=head.tokens + tail.tokens,
        token_logprobs=head.token_logprobs + tail.token_logprobs,
        top_logprobs=head.top_logprobs + tail.top_logprobs,
        text_offset=head.text_offset + tail.text_offset,
    )


async def _stream(
    generation: Generation,
    prompts: list[Prompt],
    base: CompletionResponse,
    formatter: LogprobFormatter,
    echo: bool,
    num_top: int | None,
    include_usage: bool,
) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}
    n = generation.params.n
    # Per choice: characters sent so far (for text_offset).
    offsets = [0] * (len(prompts) * n)
    echoed = [False] * len(prompts)
    num_cached = [0] * len(prompts)
    num_completion_tokens = 0

    def chunk(choice: CompletionChoice) -> str:
        return sse_event(base.model_copy(update={"choices": [choice]}), exclude=exclude)

    try:
        async for p, output in generation.stream():
            num_cached[p] = max(num_cached[p], output.num_cached_tokens)
            if echo and not echoed[p]:
                echoed[p] = True
                for j in range(n):
                    index = p * n + j
                    logprobs = None
                    if num_top is not None:
                        logprobs = _logprobs(
                            formatter, prompts[p].token_ids, output.prompt_logprobs, [], [], num_top, 0
                        )
                    offsets[index] = len(prompts[p].text)
                    yield chunk(CompletionChoice(index=index, text=prompts[p].text, logprobs=logprobs, finish_reason=None))
            for sample in output.outputs:
                index = p * n + sample.index
                num_completion_tokens += len(sample.token_ids)
                logprobs = None
                if num_top is not None and sample.logprobs:
                    logprobs = formatter.completion(sample.token_ids, sample.logprobs, num_top, offsets[index])
                offsets[index] += len(sample.text)
                if sample.text or logprobs is not None or sample.finish_reason is not None:
                    yield chunk(
                        CompletionChoice(
                            index=index, text=sample.text, logprobs=logprobs, finish_reason=sample.finish_reason
                        )
                    )
        if include_usage:
            num_prompt = sum(len(p.token_ids) for p in prompts)
            usage = Usage.of(num_prompt, num_completion_tokens, sum(num_cached))
            yield sse_event(base.model_copy(update={"usage": usage}))
    except Exception as exc:
        yield error_event(exc)
    yield DONE
