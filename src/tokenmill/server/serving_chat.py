"""POST /v1/chat/completions.

The messages (and tools) are rendered by the model's chat template and tokenized here
(chat_prompt.py), so prompt length is known before submission and the context rules are
checked up front. The request's constraint is either its `response_format` /
`structured_outputs` (constraints.py) or, with `tool_choice` "required" or a named
function, the calls' schema (tool_calls.py); never both.

With tools, each choice's text goes through a tool parser (tool_calls.ToolPlan), whose
pieces become the message's `content` and `tool_calls`, or the stream's deltas.

Streaming follows OpenAI's chunk sequence, per choice index: a first chunk with
`{"role": "assistant", "content": ""}`, content chunks `{"content": ...}` (with the
tokens' logprobs when asked) and tool-call chunks `{"tool_calls": [{index, id, type,
function: {name, arguments: ""}}]}` then `{"tool_calls": [{index, function: {arguments:
fragment}}]}`, a last chunk `{}` carrying `finish_reason`; then, with
`stream_options.include_usage`, one chunk with empty `choices` and the usage (every
earlier chunk carries `"usage": null`); then `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.chat_prompt import render_chat_prompt
from tokenmill.server.constraints import (
    Constraint,
    logits_processor_specs,
    output_constraint,
    prepare_engine,
)
from tokenmill.server.disconnect import unless_disconnected
from tokenmill.server.errors import invalid
from tokenmill.server.generation import Generation
from tokenmill.server.logprobs import LogprobFormatter
from tokenmill.server.protocol import ChatCompletionRequest, parse_request
from tokenmill.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    Usage,
)
from tokenmill.server.sampling import build_sampling_params, resolve_max_tokens
from tokenmill.server.sse import DONE, SSEResponse, error_event, sse_event
from tokenmill.server.state import get_state
from tokenmill.server.tool_calls import ToolPlan, assemble, finish_reason, stream_delta
from tokenmill.server.tool_parser import Content, ToolParser


async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_request(request, ChatCompletionRequest)
    state.check_model(body.model)
    engine = state.ready_engine()
    plan = ToolPlan.of(body)
    constraint = _constraint(body, plan)
    prompt_ids = render_chat_prompt(
        engine.tokenizer, body.messages, tools=None if plan is None else plan.prompt_tools
    )
    max_tokens = resolve_max_tokens(
        len(prompt_ids),
        body.effective_max_tokens,
        engine.max_model_len,
        param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
        prompt_param="messages",
    )
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        vocab_size=engine.model_config.vocab_size,
        logprobs=num_top,
        structured_outputs=None if constraint is None else constraint.params,
        logits_processors=logits_processor_specs(body),
    )
    await prepare_engine(engine, params, body)
    generation = Generation(
        state,
        engine,
        [prompt_ids],
        params,
        priority=body.priority,
        cache_salt=body.cache_salt,
        constraint=constraint,
    )
    chunk_base = ChatCompletionChunk(
        id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.settings.served_model_name, choices=[]
    )
    formatter = LogprobFormatter(engine.tokenizer, body.skip_special_tokens)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _stream(generation, chunk_base, formatter, num_top, include_usage, plan)
        return SSEResponse(events, on_close=generation.close)

    result = await unless_disconnected(request, generation.collect())
    choices = []
    for choice in result.choices:
        logprobs = None
        if num_top is not None:
            content = formatter.chat(choice.token_ids, choice.logprobs, num_top)
            logprobs = ChatChoiceLogprobs(content=content)
        parser = None if plan is None else plan.new_parser()
        message = AssistantMessage(content=choice.text)
        reason = choice.finish_reason
        if parser is not None:
            parsed = assemble(parser.feed(choice.text) + parser.finish())
            message = AssistantMessage(content=parsed.content, tool_calls=parsed.tool_calls or None)
            reason = finish_reason(reason, bool(parsed.tool_calls))
        choices.append(ChatChoice(index=choice.index, message=message, logprobs=logprobs, finish_reason=reason))
    response = ChatCompletionResponse(
        id=chunk_base.id,
        created=chunk_base.created,
        model=chunk_base.model,
        choices=choices,
        usage=Usage.of(result.num_prompt_tokens, result.num_completion_tokens, result.num_cached_tokens),
    )
    return JSONResponse(response.model_dump(mode="json"))


def _constraint(body: ChatCompletionRequest, plan: ToolPlan | None) -> Constraint | None:
    """The one constraint this request asks for: its response format, or a forced tool call."""
    tool_constraint = None if plan is None else plan.constraint()
    if tool_constraint is None:
        if plan is not None and plan.mode == "auto" and _asks_json(body):
            raise invalid(
                "'response_format' cannot be enforced while the model may call tools: set "
                "'tool_choice' to \"none\", \"required\" or a function",
                "response_format",
            )
        return output_constraint(body)
    if _asks_json(body) or body.structured_outputs is not None:
        param = "structured_outputs" if body.structured_outputs is not None else "response_format"
        raise invalid(
            f"'{param}' cannot be combined with a forced tool call: the calls' schema is the constraint",
            param,
        )
    return tool_constraint


def _asks_json(body: ChatCompletionRequest) -> bool:
    return body.response_format is not None and body.response_format.type != "text"


async def _stream(
    generation: Generation,
    base: ChatCompletionChunk,
    formatter: LogprobFormatter,
    num_top: int | None,
    include_usage: bool,
    plan: ToolPlan | None,
) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}

    def chunk(choice: ChatStreamChoice) -> str:
        return sse_event(base.model_copy(update={"choices": [choice]}), exclude=exclude)

    n = generation.params.n
    parsers: list[ToolParser | None] = [None if plan is None else plan.new_parser() for _ in range(n)]
    has_calls = [False] * n
    num_completion_tokens = 0
    num_cached_tokens = 0
    try:
        for index in range(n):
            yield chunk(ChatStreamChoice(index=index, delta={"role": "assistant", "content": ""}))
        async for _, output in generation.stream():
            num_cached_tokens = max(num_cached_tokens, output.num_cached_tokens)
            for sample in output.outputs:
                num_completion_tokens += len(sample.token_ids)
                logprobs = None
                if num_top is not None and sample.logprobs:
                    content = formatter.chat(sample.token_ids, sample.logprobs, num_top)
                    logprobs = ChatChoiceLogprobs(content=content) if content else None
                text, calls = sample.text, []
                parser = parsers[sample.index]
                if parser is not None:
                    pieces = parser.feed(sample.text)
                    if sample.finish_reason is not None:
                        pieces += parser.finish()
                    text = "".join(p.text for p in pieces if isinstance(p, Content))
                    calls = [stream_delta(p) for p in pieces if not isinstance(p, Content)]
                if text or logprobs is not None:
                    delta: dict[str, Any] = {"content": text}
                    yield chunk(ChatStreamChoice(index=sample.index, delta=delta, logprobs=logprobs))
                for call in calls:
                    has_calls[sample.index] = True
                    yield chunk(ChatStreamChoice(index=sample.index, delta=call))
                if sample.finish_reason is not None:
                    reason = finish_reason(sample.finish_reason, has_calls[sample.index])
                    yield chunk(ChatStreamChoice(index=sample.index, delta={}, finish_reason=reason))
        if include_usage:
            num_prompt = len(generation.prompts[0])
            usage = Usage.of(num_prompt, num_completion_tokens, num_cached_tokens)
            yield sse_event(base.model_copy(update={"usage": usage}))
    except Exception as exc:
        yield error_event(exc)
    yield DONE
