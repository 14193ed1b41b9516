"""Response bodies, shaped exactly as OpenAI's (plus vLLM's tokenize/detokenize)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, SerializerFunctionWrapHandler, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, num_prompt: int, num_completion: int, num_cached: int) -> Usage:
        return cls(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
        )


# Chat logprobs: choices[].logprobs.content[].
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class FunctionCall(BaseModel):
    name: str
    # A JSON text.
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    # Left out of the body when the message makes no call, as OpenAI does.
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _without_empty_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if not self.tool_calls:
            data.pop("tool_calls", None)
        return data


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: None = None


class ChatStreamChoice(BaseModel):
    index: int
    # {"role": "assistant", "content": ""} first, then {"content": ...} and
    # {"tool_calls": [...]}, {} last.
    delta: dict[str, Any]
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: None = None
    # Present (null until the last chunk) only with stream_options.include_usage.
    usage: Usage | None = None


# Completions logprobs: parallel lists, top_logprobs as token -> logprob.
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: None = None
    usage: Usage | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    # list of floats, or base64 of little-endian float32 with encoding_format="base64".
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tokenmill"
    root: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
