"""POST /tokenize and /detokenize, shaped as vLLM's.

/tokenize takes either `prompt` (tokenized as a completion prompt: special tokens added
by default) or `messages` (rendered by the chat template exactly as a chat request is,
so `count` is the prompt_tokens a chat request would use).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.chat_prompt import render_chat_prompt
from tokenmill.server.errors import invalid
from tokenmill.server.protocol import DetokenizeRequest, TokenizeRequest, parse_request
from tokenmill.server.responses import DetokenizeResponse, TokenizeResponse
from tokenmill.server.state import get_state


async def tokenize(request: Request) -> Response:
    state = get_state(request)
    body = await parse_request(request, TokenizeRequest)
    state.check_model(body.model)
    engine = state.ready_engine()
    tokenizer = engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise invalid("give exactly one of 'prompt' and 'messages'", "prompt")
    if body.messages is not None:
        if body.add_special_tokens:
            raise invalid("'add_special_tokens' applies to 'prompt' only", "add_special_tokens")
        tokens = render_chat_prompt(tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt)
    else:
        assert body.prompt is not None
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = tokenizer.encode(body.prompt, add_special_tokens=add_special)
    token_strs = None
    if body.return_token_strs:
        token_strs = [s or "" for s in tokenizer.convert_ids_to_tokens(tokens)]
    response = TokenizeResponse(
        count=len(tokens), max_model_len=engine.max_model_len, tokens=tokens, token_strs=token_strs
    )
    return JSONResponse(response.model_dump(mode="json"))


async def detokenize(request: Request) -> Response:
    state = get_state(request)
    body = await parse_request(request, DetokenizeRequest)
    state.check_model(body.model)
    engine = state.ready_engine()
    vocab_size = engine.model_config.vocab_size
    if any(t >= vocab_size for t in body.tokens):
        raise invalid(f"token ids must be in [0, {vocab_size})", "tokens")
    text = engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump(mode="json"))
