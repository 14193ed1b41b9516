"""POST /v1/chat/completions.

The messages are rendered by the model's chat template and tokenized here (no special
tokens added: the template writes them), so prompt length is known before submission and
the context rules are checked up front.

Streaming follows OpenAI's chunk sequence, per choice index: a first chunk with
`{"role": "assistant", "content": ""}`, content chunks `{"content": ...}` (with the
tokens' logprobs when asked), a last chunk `{}` carrying `finish_reason`; then, with
`stream_options.include_usage`, one chunk with empty `choices` and the usage (every
earlier chunk carries `"usage": null`); then `data: [DONE]`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.disconnect import unless_disconnected
from tokenmill.server.errors import invalid
from tokenmill.server.generation import Generation
from tokenmill.server.logprobs import LogprobFormatter
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage, parse_request
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

if TYPE_CHECKING:
    from tokenmill.engine.loader.tokenizer import Tokenizer


async def create_chat_completion(request: Request) -> Response:
    state = get_state(request)
    body = await parse_request(request, ChatCompletionRequest)
    state.check_model(body.model)
    engine = state.ready_engine()
    prompt_ids = render_chat_prompt(engine.tokenizer, body.messages)
    max_tokens = resolve_max_tokens(
        len(prompt_ids),
        body.effective_max_tokens,
        engine.max_model_len,
        param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
        prompt_param="messages",
    )
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    params = build_sampling_params(
        body, max_tokens=max_tokens, vocab_size=engine.model_config.vocab_size, logprobs=num_top
    )
    generation = Generation(
        state, engine, [prompt_ids], params, priority=body.priority, cache_salt=body.cache_salt
    )
    chunk_base = ChatCompletionChunk(
        id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=state.settings.served_model_name, choices=[]
    )
    formatter = LogprobFormatter(engine.tokenizer, body.skip_special_tokens)
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = _stream(generation, chunk_base, formatter, num_top, include_usage)
        return SSEResponse(events, on_close=generation.close)

    result = await unless_disconnected(request, generation.collect())
    choices = []
    for choice in result.choices:
        logprobs = None
        if num_top is not None:
            content = formatter.chat(choice.token_ids, choice.logprobs, num_top)
            logprobs = ChatChoiceLogprobs(content=content)
        choices.append(
            ChatChoice(
                index=choice.index,
                message=AssistantMessage(content=choice.text),
                logprobs=logprobs,
                finish_reason=choice.finish_reason,
            )
        )
    response = ChatCompletionResponse(
        id=chunk_base.id,
        created=chunk_base.created,
        model=chunk_base.model,
        choices=choices,
        usage=Usage.of(result.num_prompt_tokens, result.num_completion_tokens, result.num_cached_tokens),
    )
    return JSONResponse(response.model_dump(mode="json"))


def render_chat_prompt(
    tokenizer: Tokenizer, messages: list[ChatMessage], *, add_generation_prompt: bool = True
) -> list[int]:
    """Messages -> chat-template text -> token ids; a message the template rejects is a 400."""
    if not messages:
        raise invalid("'messages' must contain at least one message", "messages")
    rendered = []
    for i, message in enumerate(messages):
        if message.content is None and message.role != "assistant":
            raise invalid(f"a {message.role} message needs 'content'", f"messages[{i}].content")
        entry: dict[str, str] = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        rendered.append(entry)
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:
        raise invalid(str(exc), "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


async def _stream(
    generation: Generation,
    base: ChatCompletionChunk,
    formatter: LogprobFormatter,
    num_top: int | None,
    include_usage: bool,
) -> AsyncIterator[str]:
    exclude = None if include_usage else {"usage"}

    def chunk(choice: ChatStreamChoice) -> str:
        return sse_event(base.model_copy(update={"choices": [choice]}), exclude=exclude)

    num_completion_tokens = 0
    num_cached_tokens = 0
    try:
        for index in range(generation.params.n):
            yield chunk(ChatStreamChoice(index=index, delta={"role": "assistant", "content": ""}))
        async for _, output in generation.stream():
            num_cached_tokens = max(num_cached_tokens, output.num_cached_tokens)
            for sample in output.outputs:
                num_completion_tokens += len(sample.token_ids)
                logprobs = None
                if num_top is not None and sample.logprobs:
                    content = formatter.chat(sample.token_ids, sample.logprobs, num_top)
                    logprobs = ChatChoiceLogprobs(content=content) if content else None
                if sample.text or logprobs is not None:
                    delta = {"content": sample.text}
                    yield chunk(ChatStreamChoice(index=sample.index, delta=delta, logprobs=logprobs))
                if sample.finish_reason is not None:
                    yield chunk(ChatStreamChoice(index=sample.index, delta={}, finish_reason=sample.finish_reason))
        if include_usage:
            num_prompt = len(generation.prompts[0])
            usage = Usage.of(num_prompt, num_completion_tokens, num_cached_tokens)
            yield sse_event(base.model_copy(update={"usage": usage}))
    except Exception as exc:
        yield error_event(exc)
    yield DONE
