"""What a request's output must match: exactly one of a JSON schema, any JSON object,
a regex, a choice among strings, or a grammar (Lark in llguidance's dialect, or GBNF).

Shaped as vLLM's `structured_outputs` extra body so its clients work:
    {"json": {...schema...}} | {"json_object": true} | {"regex": "..."}
    | {"choice": ["a", "b"]} | {"grammar": "..."}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a list of strings")
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):
            try:
                parsed = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            object.__setattr__(self, "json", parsed)
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        set_kinds = [k for k in KINDS if self._value(k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(
                "structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar (got {', '.join(set_kinds) or 'none'})"
            )

    def _value(self, kind: str) -> Any:
        return getattr(self, kind)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS (the metrics label)."""
        return next(k for k in KINDS if self._value(k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """Cache key: the kind and a canonical text of its value."""
        kind = self.kind
        value = self._value(kind)
        if kind in ("json", "choice"):
            return kind, json.dumps(value, sort_keys=True, separators=(",", ":"))
        if kind == "json_object":
            return kind, ""
        return kind, str(value)
