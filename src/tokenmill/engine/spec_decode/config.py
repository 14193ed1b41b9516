"""SpeculativeConfig: the `speculative={...}` engine option, parsed and validated.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    {"method": "draft", "model": ID_OR_PATH, "num_speculative_tokens": k}
    {"method": "draft", "model": "self", "num_layers": L}

`num_speculative_tokens` is the most a request proposes per step; the policy speculates
fewer (down to none) when acceptance or the batch's cost says so. `adaptive=False` keeps
every request at k (for measuring the fixed-k baseline).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

MAX_SPECULATIVE_TOKENS = 16
METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    # n-gram: the longest and shortest suffix tried against the earlier tokens.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # draft: a model id or path, or "self" for the target's first num_layers layers.
    model: str | None = None
    num_layers: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)} (got {self.method!r})")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] (got {k!r})")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"{name} must be an integer >= 1 (got {value!r})")
            if lo > hi:
                raise ValueError(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            if self.model is not None or self.num_layers is not None:
                raise ValueError("model and num_layers apply to the draft method only")
        else:
            if not isinstance(self.model, str) or not self.model:
                raise ValueError('the draft method needs "model": a model id, a path, or "self"')
            if self.model == "self":
                n = self.num_layers
                if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                    raise ValueError('a "self" draft needs "num_layers": an integer >= 1')
            elif self.num_layers is not None:
                raise ValueError('num_layers applies to the "self" draft only')
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be a boolean (got {self.adaptive!r})")

    @property
    def is_self_draft(self) -> bool:
        return self.method == "draft" and self.model == "self"

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """From a config, a dict, a JSON object string, or None (no speculation)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the speculative config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("the speculative config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError('the speculative config needs "method" ("ngram" or "draft")')
        return cls(**value)
