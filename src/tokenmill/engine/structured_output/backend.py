"""The seam a grammar engine plugs into.

A backend compiles a StructuredOutputsParams into a CompiledGrammar (immutable, cached and
shared by every request with the same spec); each request then gets its own Matcher, the
grammar's position in that request's output. Per step, the backend fills the packed token
bitmask of every constrained row of the batch in one call.

    GrammarBackend.compile(spec) -> CompiledGrammar        raises ValueError if unsupported
    CompiledGrammar.matcher() -> Matcher
    Matcher.accept_token(t) -> bool    False: t is not allowed here (matcher is then dead)
    Matcher.is_terminated()            the grammar is complete and admits nothing more
    Matcher.validate_tokens(ts) -> n   how many of ts, in order, it would accept (no change)
    Matcher.rollback(k)                undo the last k accepted tokens
    GrammarBackend.fill_bitmask([(matcher, row)], bitmask)
    GrammarBackend.advance([(matcher, token)]) -> [terminated | None]   the batch, one call
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tokenmill.engine.structured_output.spec import StructuredOutputsParams


class Matcher(Protocol):
    def accept_token(self, token_id: int) -> bool: ...

    def is_terminated(self) -> bool: ...

    def validate_tokens(self, token_ids: list[int]) -> int: ...

    def rollback(self, num_tokens: int) -> None: ...


class CompiledGrammar(Protocol):
    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar: ...

    def fill_bitmask(self, matchers: Sequence[tuple[Matcher, int]], bitmask: torch.Tensor) -> None:
        """Write row `row` of `bitmask` (int32 [rows, ceil(vocab / 32)], CPU) for each pair."""
        ...

    def advance(self, pairs: Sequence[tuple[Matcher, int]]) -> list[bool | None]:
        """`accept_token` for each pair (one token per matcher), batched: None where the
        token was refused (that matcher is dead), else the matcher's is_terminated()."""
        ...
