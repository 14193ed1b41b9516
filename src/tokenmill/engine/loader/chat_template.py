"""The model's own chat template, rendered the way transformers' `apply_chat_template` does.

Templates are jinja2 source shipped with the checkpoint (GGUF `tokenizer.chat_template`
or tokenizer_config.json). They are untrusted code, so they run in jinja2's immutable
sandbox. To render byte-for-byte what transformers renders, the environment matches
theirs: `trim_blocks` + `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}`
tag (rendered as its body), a `tojson` that keeps non-ASCII characters, and the globals
`raise_exception` and `strftime_now`. Special tokens (`bos_token`, `eos_token`, ...) are
template variables.

One difference on purpose: a message whose content is a list of OpenAI-style parts
(`[{"type": "text", "text": ...}, ...]`) is joined into one string (parts separated by
"\\n", as vLLM does), since text-only templates index `message['content']` as a string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a checkpoint ships no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; render the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None) -> None:
        """`special_tokens`: template variables such as {"bos_token": "<s>", "eos_token": "</s>"}."""
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"invalid chat template (line {e.lineno}): {e.message}") from e

    @classmethod
    def chatml(cls, special_tokens: Mapping[str, str | None] | None = None) -> ChatTemplate:
        """The fallback for checkpoints without a template."""
        return cls(CHATML_TEMPLATE, special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`; extra kwargs (documents, enable_thinking, ...) reach the template."""
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._template.render(
                messages=[normalize_message(m) for m in messages],
                tools=list(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e


def normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A plain-dict copy of `message` with list-of-parts content joined into one string."""
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"a chat message must be a mapping with a 'role', got {message!r}")
    normalized = dict(message)
    content = normalized.get("content")
    if isinstance(content, list):
        normalized["content"] = "\n".join(_part_text(part) for part in content)
    return normalized


def _part_text(part: Any) -> str:
    if isinstance(part, str):
        return part
    if (
        isinstance(part, Mapping)
        and part.get("type", "text") == "text"
        and isinstance(part.get("text"), str)
    ):
        return part["text"]
    kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
    raise ValueError(f"unsupported message content part {kind!r}: this model takes text only")
