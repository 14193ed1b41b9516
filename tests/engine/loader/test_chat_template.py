"""ChatTemplate: HF-compatible rendering, errors, fallback; the default model's template vs transformers."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from tokenmill.engine.loader.chat_template import ChatTemplate, normalize_message
from tokenmill.engine.loader.gguf import GGUFFile
from tokenmill.engine.loader.model_store import resolve_model


def default_gguf() -> Path:
    """The default model's GGUF in the store (`make test` pulls it first)."""
    return resolve_model("smollm2-135m-instruct")

USER = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user_only": USER,
    "with_system": [{"role": "system", "content": "You are terse."}, *USER],
    "multi_turn": [
        *USER,
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? Answer in 日本語 🙂"},
    ],
    "whitespace": [{"role": "user", "content": "  indented\n\n\ttext  "}],
}

# A Llama-3.1-style template: bos_token, tools, tojson with indent, raise_exception.
TOOL_TEMPLATE = """{{- bos_token }}
{%- if tools is not none %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTools:\\n' }}
{%- for t in tools %}{{- t | tojson(indent=2) }}{{- '\\n' }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + message['role']) }}{% endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
TOOLS = [{"type": "function", "function": {"name": "météo", "parameters": {"type": "object"}}}]


def test_chatml_fallback() -> None:
    template = ChatTemplate.chatml()
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert template.render(messages) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nu<|im_end|>\n<|im_start|>assistant\n"
    )
    assert template.render(messages, add_generation_prompt=False).endswith("u<|im_end|>\n")


def test_special_tokens_kwargs_and_trim_blocks() -> None:
    template = ChatTemplate(
        "{% for m in messages %}\n  {{ bos_token }}{{ m['content'] }}{{ suffix }}\n{% endfor %}",
        {"bos_token": "<s>", "eos_token": None},
    )
    # trim_blocks drops the newline after a block tag, lstrip_blocks the spaces before one
    assert template.render(USER * 2, suffix="!") == "  <s>What is the capital of France?!\n" * 2


def test_list_of_text_parts_is_joined() -> None:
    message = {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"text": "c"}]}
    assert normalize_message(message) == {"role": "user", "content": "a\nb\nc"}
    assert message["content"][1] == "b"  # the caller's message is not modified
    with pytest.raises(ValueError, match="unsupported message content part 'image_url'"):
        normalize_message({"role": "user", "content": [{"type": "image_url", "image_url": {}}]})
    with pytest.raises(ValueError, match="must be a mapping with a 'role'"):
        normalize_message({"content": "x"})


def test_tojson_keeps_unicode_and_options() -> None:
    template = ChatTemplate(
        "{{ tools | tojson }}|{{ {'b': 1, 'a': 'é'} | tojson(sort_keys=True) }}"
    )
    assert template.render([], tools=[{"n": "é<>"}]) == '[{"n": "é<>"}]|{"a": "é", "b": 1}'


def test_raise_exception_and_runtime_errors_become_value_errors() -> None:
    template = ChatTemplate("{{ raise_exception('only user messages') }}")
    with pytest.raises(ValueError, match="chat template error: only user messages"):
        template.render(USER)
    # the sandbox is immutable: templates cannot mutate the messages they are given
    with pytest.raises(ValueError, match="chat template error"):
        ChatTemplate("{{ messages.append(1) }}").render(USER)


def test_syntax_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"invalid chat template \(line 1\)"):
        ChatTemplate("{% for m in messages %}{{ m }")


def test_generation_tag_loop_controls_and_strftime_now() -> None:
    template = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}{{ strftime_now('%Y') }}"
    )
    before = datetime.datetime.now().strftime("%Y")
    rendered = template.render([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])
    after = datetime.datetime.now().strftime("%Y")
    assert rendered in (f"[x]{before}", f"[x]{after}")


# ---- against transformers' apply_chat_template (slow) ---------------------------------


@pytest.fixture(scope="module")
def default_template_source() -> tuple[str, dict[str, str]]:
    """The default model's template and its bos/eos strings, as the GGUF file states them."""
    metadata = GGUFFile(default_gguf()).metadata
    tokens = metadata["tokenizer.ggml.tokens"]
    special = {
        "bos_token": tokens[metadata["tokenizer.ggml.bos_token_id"]],
        "eos_token": tokens[metadata["tokenizer.ggml.eos_token_id"]],
    }
    return metadata["tokenizer.chat_template"], special


def hf_reference(template: str, special: dict[str, str]) -> Any:
    """A transformers tokenizer carrying `template`: its apply_chat_template is the reference.

    Rendering never touches the vocabulary, so a one-token backend stands in for the real one
    (loading the GGUF tokenizer through transformers costs seconds and changes nothing here).
    """
    transformers = pytest.importorskip("transformers")
    backend = HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, chat_template=template, **special
    )


@pytest.fixture(scope="module")
def hf_tokenizer(default_template_source: tuple[str, dict[str, str]]) -> Any:
    return hf_reference(*default_template_source)


@pytest.fixture(scope="module")
def default_template(default_template_source: tuple[str, dict[str, str]]) -> ChatTemplate:
    return ChatTemplate(*default_template_source)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_template_equals_transformers(
    hf_tokenizer: Any, default_template: ChatTemplate, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    expected = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        default_template.render(messages, add_generation_prompt=add_generation_prompt) == expected
    )


@pytest.mark.slow
def test_list_of_parts_renders_like_the_joined_string(
    hf_tokenizer: Any, default_template: ChatTemplate
) -> None:
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
        }
    ]
    joined = [{"role": "user", "content": "Hello\nthere"}]
    expected = hf_tokenizer.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
    assert default_template.render(parts) == expected
    assert "Hello\nthere<|im_end|>" in expected


@pytest.mark.slow
def test_tool_template_equals_transformers() -> None:
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    reference = hf_reference(TOOL_TEMPLATE, special)
    ours = ChatTemplate(TOOL_TEMPLATE, special)
    messages = CONVERSATIONS["multi_turn"]
    for tools in (None, TOOLS):
        expected = reference.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert ours.render(messages, tools=tools) == expected
    assert '"name": "météo"' in ours.render(messages, tools=TOOLS)
    with pytest.raises(ValueError, match="bad role tool"):
        ours.render([{"role": "tool", "content": "x"}])
