"""Request bodies of the OpenAI-compatible API, validated strictly.

The rule: never silently drop a field that changes what the caller gets. Every model
forbids unknown fields (400 naming the field). Fields fall in four groups:

- honored: OpenAI's parameters the server implements;
- extensions: vLLM's extra-body names (`top_k`, `min_p`, ...) so its clients work;
- harmless: accepted and ignored because they cannot change the output (`metadata`,
  `store`, `service_tier`, `safety_identifier`, `prompt_cache_key`, `stream_options.include_obfuscation`);
- known but not honored yet (`functions`, `audio`, ...): declared so that
  `rejected_field()` can reject them by name with a 400 unless they hold their no-op value.

Structured outputs (`response_format`, vLLM's `structured_outputs`), `logits_processors`
and tools (`tools`, `tool_choice`, `parallel_tool_calls`, `role: "tool"` messages,
assistant `tool_calls`) are honored; the rules across fields (one constraint at most, a
known tool name, ...) are checked where the request is built (constraints.py,
tool_calls.py, chat_prompt.py).

Types are strict (a string is not a number) and bounds live on the fields, so a bad value
is reported with its `param`.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, JsonValue, Tag, ValidationError

from tokenmill.engine.request import MAX_LOGPROBS, MAX_N
from tokenmill.server.errors import APIError, from_validation_errors

# (param, message) of a field the server refuses.
Rejection = tuple[str, str]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictModel):
    include_usage: bool = False
    # Harmless: obfuscation padding is a transport detail; this server never adds any.
    include_obfuscation: bool | None = None


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(StrictModel):
    name: str
    # A JSON text, as the API returned it.
    arguments: str


class ToolCall(StrictModel):
    """A call an assistant message made, sent back in a later turn."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(StrictModel):
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    # Passed to the chat template as a message key (templates that use it honor it).
    name: str | None = None
    # Assistant messages only: the calls it made.
    tool_calls: list[ToolCall] | None = None
    # Tool messages only: the call this is the result of.
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class JsonSchemaSpec(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    # `schema` would shadow a BaseModel attribute; the wire name is the alias.
    schema_: dict[str, JsonValue] = Field(alias="schema")
    # Accepted either way: the schema is always enforced.
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(StrictModel):
    """One model, not a tagged union, so errors name `response_format.json_schema.<field>`;
    `json_schema` goes with type "json_schema" only (checked in constraints.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputsField(StrictModel):
    """vLLM's extra body: exactly one of these (checked by StructuredOutputsParams)."""

    # `json` would shadow a BaseModel attribute; the wire name is the alias.
    json_: dict[str, JsonValue] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class LogitsProcessorEntry(StrictModel):
    name: str
    args: dict[str, JsonValue] = Field(default_factory=dict)


def _name_or_entry(value: object) -> str:
    return "str" if isinstance(value, str) else "dict"


# Tagged "str" / "dict" (tags errors.param_from_loc drops), so an error inside an entry is
# reported as `logits_processors[i].<field>`.
LogitsProcessorItem = Annotated[
    Annotated[str, Tag("str")] | Annotated[LogitsProcessorEntry, Tag("dict")],
    Discriminator(_name_or_entry),
]


class SamplingFields(StrictModel):
    """Fields shared by chat and completions: sampling, stopping, constraints, vLLM extensions."""

    model: str | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    user: str | None = None
    # Harmless (accepted, ignored).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured outputs: OpenAI's field, and vLLM's extra body.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    # Batch logits processors by registered name, with optional arguments.
    logits_processors: list[LogitsProcessorItem] | None = None

    def rejected_field(self) -> Rejection | None:
        """The first field holding a value this server cannot honor, and why."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "'stream_options' is only allowed when 'stream' is true"
        return None

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    # A JSON schema of the arguments object; omitted: the function takes no arguments.
    parameters: dict[str, JsonValue] | None = None
    # Accepted either way: constrained calls always follow `parameters`.
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Known OpenAI fields not honored yet.
    functions: JsonValue = None
    function_call: JsonValue = None
    audio: JsonValue = None
    modalities: JsonValue = None
    prediction: JsonValue = None
    reasoning_effort: JsonValue = None
    web_search_options: JsonValue = None
    verbosity: JsonValue = None

    def rejected_field(self) -> Rejection | None:
        noop: dict[str, tuple[JsonValue, ...]] = {
            "functions": (None, []),
            "function_call": (None, "none"),
            "modalities": (None, ["text"]),
        }
        for name in type(self).model_fields:
            unhonored = name in noop or name in _UNHONORED_CHAT
            if unhonored and getattr(self, name) not in noop.get(name, (None,)):
                return name, _not_supported(name)
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "'top_logprobs' needs 'logprobs' set to true"
        return super().rejected_field()

    @property
    def effective_max_tokens(self) -> int | None:
        """`max_completion_tokens` is OpenAI's newer name and wins over `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


_UNHONORED_CHAT = frozenset(
    {"audio", "prediction", "reasoning_effort", "web_search_options", "verbosity"}
)


class CompletionRequest(SamplingFields):
    # str | list[str] | list[int] | list[list[int]], checked by the serving layer.
    prompt: JsonValue
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Legacy default.
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    def rejected_field(self) -> Rejection | None:
        if self.suffix:
            return "suffix", _not_supported("suffix")
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "'best_of' other than 'n' is not supported by this server"
        return super().rejected_field()


class EmbeddingRequest(StrictModel):
    # str | list[str] | list[int] | list[list[int]], checked by the serving layer.
    input: JsonValue
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    add_special_tokens: bool = True

    def rejected_field(self) -> Rejection | None:
        return ("dimensions", _not_supported("dimensions")) if self.dimensions is not None else None


class TokenizeRequest(StrictModel):
    """Either `prompt` (a completion prompt) or `messages` (rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def rejected_field(self) -> Rejection | None:
        return None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]

    def rejected_field(self) -> Rejection | None:
        return None


Body = TypeVar(
    "Body", ChatCompletionRequest, CompletionRequest, EmbeddingRequest, TokenizeRequest, DetokenizeRequest
)


async def parse_request(request: Request, model: type[Body]) -> Body:
    """Read and validate a JSON body; every failure is a 400 naming the field when it can."""
    raw = await request.body()
    try:
        body = model.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None
    rejection = body.rejected_field()
    if rejection is not None:
        param, message = rejection
        raise APIError(400, message, param=param, code="unsupported_parameter")
    return body


def _not_supported(name: str) -> str:
    return f"'{name}' is not supported by this server yet; remove it from the request"
