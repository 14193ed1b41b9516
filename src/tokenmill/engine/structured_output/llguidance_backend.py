"""The default grammar backend: llguidance.

Chosen over xgrammar on this CPU by measurement (shared/ENGINE-NOTES.md): compiling a
JSON schema takes ~1 ms (lazy lexer) against 5-400 ms, a batch of masks is filled in
parallel in one call, its wheel has no dependencies (xgrammar pulls ~1 GB of triton), and
it refuses JSON-schema keywords it cannot enforce by name ('Unimplemented keys: ["if"]')
instead of dropping them. The tokenizer is handed over as the HF tokenizers JSON.

Constrained JSON is compact: no free whitespace between tokens (`whitespace_flexible` off),
so a small model cannot spend max_tokens on blanks.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.torch
import torch

from tokenmill.engine.structured_output.spec import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}
# Consume a batch's tokens on llguidance's thread pool only where cores are plentiful.
_PARALLEL_CONSUME = len(os.sched_getaffinity(0)) > 4


class LlguidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.inner = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.inner.consume_token(token_id)) and not self.inner.is_error()

    def is_terminated(self) -> bool:
        return bool(self.inner.is_stopped())

    def validate_tokens(self, token_ids: list[int]) -> int:
        return int(self.inner.validate_tokens(token_ids))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.inner.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self.inner.get_error()}")


class LlguidanceGrammar:
    def __init__(self, template: llguidance.LLMatcher) -> None:
        # Never advanced: each request's matcher is a copy of this start state.
        self._template = template

    def matcher(self) -> LlguidanceMatcher:
        return LlguidanceMatcher(self._template.deep_copy())


class LlguidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer_json = tokenizer_json
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._executor: llguidance.LLExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        # Built on first use (~0.4 s for a 49k vocabulary), on the compile thread.
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self._vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> LlguidanceGrammar:
        grammar = _grammar_text(spec)
        tokenizer = self.tokenizer
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ValueError(f"unsupported {_label(spec.kind)}: {'; '.join(messages)}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"unsupported {_label(spec.kind)}: {matcher.get_error()}")
        return LlguidanceGrammar(matcher)

    def fill_bitmask(self, matchers: Sequence[tuple[Any, int]], bitmask: torch.Tensor) -> None:
        pairs = [(m.inner, row) for m, row in matchers]
        if len(pairs) == 1:
            llguidance.torch.fill_next_token_bitmask(pairs[0][0], bitmask, pairs[0][1])
        else:
            llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def advance(self, pairs: Sequence[tuple[Any, int]]) -> list[bool | None]:
        # consume_token is False exactly when the matcher errs (llguidance's contract).
        if len(pairs) == 1 or not _PARALLEL_CONSUME:
            # One token per matcher costs ~1.2-2 us: spread over llguidance's thread pool
            # it only pays with cores to spare. On the 2-core CPU 64 rows took 0.13-0.15 ms
            # through consume_token_par against 0.08-0.13 ms in this loop.
            return [m.inner.is_stopped() if m.inner.consume_token(t) else None for m, t in pairs]
        accepted = self.executor.consume_token_par([(m.inner, t) for m, t in pairs])
        return [m.inner.is_stopped() if ok else None for ok, (m, _) in zip(accepted, pairs, strict=True)]

    @property
    def executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor


def _grammar_text(spec: StructuredOutputsParams) -> str:
    kind = spec.kind
    try:
        if kind == "json":
            schema = spec.json
            if schema is True:
                schema = {}
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), defaults=_JSON_OPTIONS
            )
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps({"type": "object"}), defaults=_JSON_OPTIONS
            )
        if kind == "regex":
            assert spec.regex is not None
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            assert spec.choice is not None
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
        assert spec.grammar is not None
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as exc:
        raise ValueError(f"unsupported {_label(kind)}: {exc}") from None


def _label(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}[kind]
