from __future__ import annotations

from typing import Any

from tokenmill.gateway.tiers.cascade import (
    escalation_reason,
    mean_logprob,
    strip_logprobs,
    with_logprobs,
)


def chat(content: str, logprobs: list[float]) -> dict[str, Any]:
    tokens = [{"token": "t", "logprob": v} for v in logprobs]
    return {"choices": [{"message": {"content": content}, "logprobs": {"content": tokens}}]}


def test_mean_logprob_chat_and_completions() -> None:
    assert mean_logprob(chat("x", [-0.5, -1.5])) == -1.0
    completion = {"choices": [{"text": "x", "logprobs": {"token_logprobs": [-0.2, None, -0.4]}}]}
    assert mean_logprob(completion) == -0.30000000000000004
    assert mean_logprob({"choices": []}) is None


def test_escalates_on_low_confidence_or_bad_json() -> None:
    assert escalation_reason(chat("fine", [-0.1, -0.3]), {}, -1.0) is None
    assert escalation_reason(chat("unsure", [-2.0, -1.0]), {}, -1.0) == "low_confidence"
    wants_json = {"response_format": {"type": "json_object"}}
    assert escalation_reason(chat('{"a": 1}', [-0.1]), wants_json, -1.0) is None
    assert escalation_reason(chat('{"a": ', [-0.1]), wants_json, -1.0) == "invalid_json"
    assert escalation_reason({"choices": [{"message": {"content": "x"}, "logprobs": None}]}, {}, -1.0) == "low_confidence"


def test_probe_asks_for_logprobs_and_strip_removes_them() -> None:
    assert with_logprobs({"messages": []}, "/v1/chat/completions") == {"messages": [], "logprobs": True}
    assert with_logprobs({"prompt": "p"}, "/v1/completions") == {"prompt": "p", "logprobs": 0}
    assert with_logprobs({"prompt": "p", "logprobs": 2}, "/v1/completions") == {"prompt": "p", "logprobs": 2}
    assert strip_logprobs(chat("x", [-1.0]))["choices"][0]["logprobs"] is None
