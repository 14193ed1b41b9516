"""Cascade: answer with the small tier, escalate to the larger one when it is unsure.

The small tier is asked with token logprobs on. Its answer is kept when the mean logprob of
its first choice's tokens is at least `min_mean_logprob` and, for a JSON response format,
the content parses as JSON; otherwise the same request goes to the next tier up and that
answer is returned. The client sees which tier answered in `x-tokenmill-tier`, and logprobs
it did not ask for are removed from the kept answer. Only non-streamed chat and completions
requests cascade (a streamed answer cannot be taken back).
"""

from __future__ import annotations

import json
from typing import Any


def with_logprobs(payload: dict[str, Any], path: str) -> dict[str, Any]:
    probe = dict(payload)
    if path.endswith("/chat/completions"):
        probe["logprobs"] = True
    elif not isinstance(payload.get("logprobs"), int):
        probe["logprobs"] = 0
    return probe


def mean_logprob(response: dict[str, Any]) -> float | None:
    choices = response.get("choices") or []
    if not choices:
        return None
    logprobs = choices[0].get("logprobs") or {}
    if "content" in logprobs:  # chat
        values = [t["logprob"] for t in logprobs["content"] or []]
    else:  # completions
        values = [v for v in logprobs.get("token_logprobs") or [] if v is not None]
    return sum(values) / len(values) if values else None


def escalation_reason(response: dict[str, Any], payload: dict[str, Any], min_mean_logprob: float) -> str | None:
    """Why the small tier's answer is not good enough, or None to keep it."""
    response_format = payload.get("response_format") or {}
    if isinstance(response_format, dict) and response_format.get("type") in ("json_object", "json_schema"):
        choices = response.get("choices") or [{}]
        content = (choices[0].get("message") or {}).get("content") or choices[0].get("text") or ""
        try:
            json.loads(content)
        except ValueError:
            return "invalid_json"
    mean = mean_logprob(response)
    if mean is None or mean < min_mean_logprob:
        return "low_confidence"
    return None


def strip_logprobs(response: dict[str, Any]) -> dict[str, Any]:
    for choice in response.get("choices") or []:
        choice["logprobs"] = None
    return response
