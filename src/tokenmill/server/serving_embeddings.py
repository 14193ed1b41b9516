"""POST /v1/embeddings: mean-pooled, L2-normalized last hidden states, one per input.

`input` takes the same four shapes as a completion prompt. `encoding_format="base64"`
returns each vector as base64 of little-endian float32, as OpenAI does (its Python
client asks for base64 by default and decodes it).
"""

from __future__ import annotations

import base64
import struct

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenmill.server.disconnect import unless_disconnected
from tokenmill.server.errors import invalid
from tokenmill.server.protocol import EmbeddingRequest, parse_request
from tokenmill.server.responses import EmbeddingData, EmbeddingResponse, EmbeddingUsage
from tokenmill.server.serving_completions import parse_prompts
from tokenmill.server.state import get_state


async def create_embedding(request: Request) -> Response:
    state = get_state(request)
    body = await parse_request(request, EmbeddingRequest)
    state.check_model(body.model)
    engine = state.ready_engine()
    prompts = parse_prompts(
        body.input,
        engine.tokenizer,
        engine.model_config.vocab_size,
        add_special_tokens=body.add_special_tokens,
        param="input",
    )
    for i, prompt in enumerate(prompts):
        if len(prompt.token_ids) > engine.max_model_len:
            raise invalid(
                f"input {i} is {len(prompt.token_ids)} tokens, over this model's context of {engine.max_model_len}",
                "input",
            )
    token_ids = [p.token_ids for p in prompts]
    try:
        vectors = await unless_disconnected(request, engine.embed(token_ids))
    except ValueError as exc:
        raise invalid(str(exc), "input") from None
    data = [
        EmbeddingData(index=i, embedding=_encode(v) if body.encoding_format == "base64" else v)
        for i, v in enumerate(vectors)
    ]
    num_tokens = sum(len(ids) for ids in token_ids)
    response = EmbeddingResponse(
        data=data,
        model=state.settings.served_model_name,
        usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )
    return JSONResponse(response.model_dump(mode="json"))


def _encode(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
