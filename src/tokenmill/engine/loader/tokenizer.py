"""Tokenizer: HF `tokenizers` underneath, built from tokenizer.json or from GGUF metadata.

From a GGUF file the tokenizer is rebuilt the way transformers' GGUF loader builds it, so
ids agree with `AutoTokenizer.from_pretrained(dir, gguf_file=...)`:

  * vocab + merges become a byte-level BPE. A token that uses characters outside the
    GPT-2 byte alphabet is re-spelled in it (its UTF-8 bytes mapped through the alphabet).
  * tokens typed CONTROL (3) become special added tokens (kept whole, dropped by
    `decode(skip_special_tokens=True)`); USER_DEFINED (4) become plain added tokens.
  * the pre-tokenizer follows `tokenizer.ggml.pre`: the regex split llama.cpp uses for
    that vocabulary, then byte-level mapping. "smollm" splits digits one by one before
    GPT-2's regex, as SmolLM's own tokenizer.json does (transformers skips the digit rule;
    the vocabulary has no multi-digit merges, so the ids agree).
  * a BOS is prepended by `encode(add_special_tokens=True)` only when the file sets
    `tokenizer.ggml.add_bos_token`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from tokenmill.engine.loader.chat_template import ChatTemplate

_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp's split regexes per `tokenizer.ggml.pre` (same as transformers' table).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_REGEX = {
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# GPT-2's own regex (ByteLevel use_regex=True), optionally after splitting digits.
_GPT2_STYLE = {"gpt2": False, "default": False, "smollm": True}


class Tokenizer:
    """Text <-> token ids, special tokens, end-of-sequence ids and the chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        chat_template: ChatTemplate,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        added = backend.get_added_tokens_decoder()
        self._special_token_ids = frozenset(i for i, token in added.items() if token.special)

    # ---- construction -------------------------------------------------------------

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        tokenizer_config: Mapping[str, Any] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> Tokenizer:
        """From tokenizer.json plus the parsed tokenizer_config.json (special tokens, template).

        `extra_eos_token_ids`: generation_config.json's eos ids. `chat_template` overrides the
        config's template (a chat_template.jinja file next to the checkpoint).
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        backend = tokenizers.Tokenizer.from_file(str(path))
        config = dict(tokenizer_config or {})
        tokens = {
            name: _token_content(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        bos_id = backend.token_to_id(tokens["bos_token"]) if tokens["bos_token"] else None
        eos_id = backend.token_to_id(tokens["eos_token"]) if tokens["eos_token"] else None
        eos_ids = ([] if eos_id is None else [eos_id]) + list(extra_eos_token_ids)
        source = (
            chat_template
            if chat_template is not None
            else _config_template(config.get("chat_template"))
        )
        template = ChatTemplate(source, tokens) if source else ChatTemplate.chatml(tokens)
        return cls(backend, template, bos_id, eos_ids)

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """From GGUF `tokenizer.*` metadata (a byte-level BPE vocabulary)."""
        model = metadata.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = _byte_level_bpe(tokens, metadata.get("tokenizer.ggml.merges"))
        backend.pre_tokenizer = _gguf_pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()

        alphabet = _byte_alphabet()
        backend.add_special_tokens(
            [
                AddedToken(token, normalized=False, special=True)
                for token, kind in zip(tokens, token_types, strict=True)
                # a "control" token outside the byte alphabet is a converter mislabel; adding
                # it would grow the vocabulary past the model's embedding rows
                if kind == _CONTROL and set(token) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(token, normalized=False, special=False)
                for token, kind in zip(tokens, token_types, strict=True)
                if kind == _USER_DEFINED and backend.token_to_id(token) is not None
            ]
        )

        def token_at(key: str) -> str | None:
            token_id = metadata.get(f"tokenizer.ggml.{key}")
            return (
                tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
            )

        bos_id = metadata.get("tokenizer.ggml.bos_token_id")
        if metadata.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
            bos = tokens[bos_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
            )
        special_tokens = {
            "bos_token": token_at("bos_token_id"),
            "eos_token": token_at("eos_token_id"),
            "unk_token": token_at("unknown_token_id"),
            "pad_token": token_at("padding_token_id"),
        }
        source = metadata.get("tokenizer.chat_template")
        template = (
            ChatTemplate(source, special_tokens) if source else ChatTemplate.chatml(special_tokens)
        )
        eos_ids = [
            metadata[f"tokenizer.ggml.{key}"]
            for key in ("eos_token_id", "eot_token_id", "eom_token_id")
            if metadata.get(f"tokenizer.ggml.{key}") is not None
        ]
        return cls(backend, template, bos_id, eos_ids)

    # ---- API ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`. Special tokens written in the text are matched whole."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation: eos, then declared end-of-turn ids (deduplicated)."""
        return self._eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self._special_token_ids

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text the model's chat template renders for `messages`."""
        return self.chat_template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
        )


@cache
def _byte_alphabet() -> frozenset[str]:
    return frozenset(_bytes_to_unicode().values())


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (bytes 33-126 etc. map to themselves)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _byte_level_bpe(tokens: Sequence[str], merges: Sequence[str] | None) -> tokenizers.Tokenizer:
    if merges is None:
        raise ValueError("GGUF byte-level tokenizer has no tokenizer.ggml.merges")
    alphabet, spelling = _byte_alphabet(), _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    pairs = []
    for merge in merges:
        left, _, right = merge.partition(" ")
        pairs.append((left, right))
    return tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    )


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLIT_REGEX:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_REGEX[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre in _GPT2_STYLE:
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if _GPT2_STYLE[pre]:
            return pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        return byte_level
    supported = sorted([*_SPLIT_REGEX, *_GPT2_STYLE])
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {supported})")


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or a serialized AddedToken.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_template(value: Any) -> str | None:
    # A string, or a list of {"name", "template"} with the "default" one first choice.
    if isinstance(value, list):
        named = {
            entry.get("name"): entry.get("template")
            for entry in value
            if isinstance(entry, Mapping)
        }
        value = named.get("default")
    return value if isinstance(value, str) else None
