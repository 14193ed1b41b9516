"""The tier classifier seam: which tier (small / large model) answers an `auto` request.

A classifier sees `RequestFeatures` and names a tier. The built-in `RulesClassifier` takes
the first configured rule that matches (every condition a rule sets must hold: prompt at
least `min_prompt_chars`, a requested reasoning budget of at least `min_reasoning_tokens`,
one of `keywords` in the prompt, the tenant among `tenants`), else the default tier. Any
other classifier is named "package.module:Class" in the config, built with `options` as
keyword arguments, and must return one of the configured tiers.

The reasoning budget is read from `max_reasoning_tokens`, `thinking.budget_tokens`, or
`reasoning_effort` (low 1024, medium 4096, high 16384 tokens).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.gateway.config import TierRule, TiersConfig

REASONING_EFFORT_TOKENS = {"low": 1024, "medium": 4096, "high": 16384}


@dataclass(frozen=True)
class RequestFeatures:
    prompt_text: str
    max_tokens: int | None
    reasoning_tokens: int
    tenant: str

    @classmethod
    def of(cls, payload: Mapping[str, Any], prompt_text: str, tenant: str) -> RequestFeatures:
        return cls(prompt_text, requested_max_tokens(payload), reasoning_budget(payload), tenant)


def requested_max_tokens(payload: Mapping[str, Any]) -> int | None:
    for field in ("max_completion_tokens", "max_tokens"):
        value = payload.get(field)
        if isinstance(value, int):
            return value
    return None


def reasoning_budget(payload: Mapping[str, Any]) -> int:
    value = payload.get("max_reasoning_tokens")
    if isinstance(value, int):
        return value
    thinking = payload.get("thinking")
    if isinstance(thinking, Mapping) and isinstance(thinking.get("budget_tokens"), int):
        return int(thinking["budget_tokens"])
    effort = payload.get("reasoning_effort")
    return REASONING_EFFORT_TOKENS.get(effort, 0) if isinstance(effort, str) else 0


class TierClassifier(Protocol):
    def classify(self, features: RequestFeatures) -> str: ...


class RulesClassifier:
    def __init__(self, rules: Sequence[TierRule], default: str) -> None:
        self.rules = list(rules)
        self.default = default

    def classify(self, features: RequestFeatures) -> str:
        text = features.prompt_text.lower()
        for rule in self.rules:
            if rule.min_prompt_chars is not None and len(features.prompt_text) < rule.min_prompt_chars:
                continue
            if rule.min_reasoning_tokens is not None and features.reasoning_tokens < rule.min_reasoning_tokens:
                continue
            if rule.keywords and not any(k.lower() in text for k in rule.keywords):
                continue
            if rule.tenants and features.tenant not in rule.tenants:
                continue
            return rule.tier
        return self.default


class CheckedClassifier:
    """Wraps a plugged-in classifier: an unknown tier from it is a bug, said clearly."""

    def __init__(self, inner: TierClassifier, tiers: Sequence[str]) -> None:
        self.inner = inner
        self.tiers = set(tiers)

    def classify(self, features: RequestFeatures) -> str:
        tier = self.inner.classify(features)
        if tier not in self.tiers:
            raise RuntimeError(f"classifier {type(self.inner).__name__} returned unknown tier {tier!r}")
        return tier


def make_classifier(config: TiersConfig) -> TierClassifier:
    if config.classifier == "rules":
        return RulesClassifier(config.rules, config.default)
    module_name, _, class_name = config.classifier.partition(":")
    if not class_name:
        raise ValueError(f"tiers.classifier must be 'rules' or 'package.module:Class', got {config.classifier!r}")
    try:
        factory = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"tiers.classifier {config.classifier!r} cannot be loaded: {exc}") from None
    return CheckedClassifier(factory(**config.options), list(config.models))
