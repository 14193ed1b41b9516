from __future__ import annotations

from typing import Any

import pytest

from tokenmill.gateway.config import TiersConfig
from tokenmill.gateway.tiers.classifier import RequestFeatures, make_classifier, reasoning_budget

TIERS = {"small": "m-small", "large": "m-large"}


def classify(rules: list[dict[str, Any]], payload: dict[str, Any], text: str, tenant: str = "t") -> str:
    config = TiersConfig.model_validate({"models": TIERS, "default": "small", "rules": rules})
    return make_classifier(config).classify(RequestFeatures.of(payload, text, tenant))


def test_first_matching_rule_wins_else_default() -> None:
    rules = [
        {"tier": "large", "min_prompt_chars": 100},
        {"tier": "large", "keywords": ["Prove"]},
        {"tier": "large", "min_reasoning_tokens": 2000},
        {"tier": "large", "tenants": ["vip"]},
    ]
    assert classify(rules, {}, "short question") == "small"
    assert classify(rules, {}, "x" * 100) == "large"
    assert classify(rules, {}, "please prove this lemma") == "large"
    assert classify(rules, {"reasoning_effort": "medium"}, "hi") == "large"
    assert classify(rules, {"reasoning_effort": "low"}, "hi") == "small"
    assert classify(rules, {}, "hi", tenant="vip") == "large"


def test_a_rule_needs_all_its_conditions() -> None:
    rules = [{"tier": "large", "min_prompt_chars": 10, "keywords": ["derive"]}]
    assert classify(rules, {}, "derive") == "small"
    assert classify(rules, {}, "derive the formula") == "large"


def test_reasoning_budget_sources() -> None:
    assert reasoning_budget({"max_reasoning_tokens": 500}) == 500
    assert reasoning_budget({"thinking": {"budget_tokens": 800}}) == 800
    assert reasoning_budget({"reasoning_effort": "high"}) == 16384
    assert reasoning_budget({}) == 0


class AlwaysLarge:
    def __init__(self, tier: str) -> None:
        self.tier = tier

    def classify(self, features: RequestFeatures) -> str:
        return self.tier


def test_plugged_in_classifier_is_built_with_options_and_checked() -> None:
    name = f"{__name__}:AlwaysLarge"
    good = TiersConfig.model_validate({"models": TIERS, "default": "small", "classifier": name, "options": {"tier": "large"}})
    assert make_classifier(good).classify(RequestFeatures("x", None, 0, "t")) == "large"
    bad = TiersConfig.model_validate({"models": TIERS, "default": "small", "classifier": name, "options": {"tier": "huge"}})
    with pytest.raises(RuntimeError, match="unknown tier 'huge'"):
        make_classifier(bad).classify(RequestFeatures("x", None, 0, "t"))
    missing = TiersConfig.model_validate({"models": TIERS, "default": "small", "classifier": "no.such.module:X"})
    with pytest.raises(ValueError, match="cannot be loaded"):
        make_classifier(missing)
