from __future__ import annotations

import pytest

from tokenmill.engine.spec_decode.config import SpeculativeConfig


def test_parse_from_dict_json_and_none() -> None:
    assert SpeculativeConfig.parse(None) is None
    ngram = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert ngram == SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=4)
    self_draft = SpeculativeConfig.parse('{"method": "draft", "model": "self", "num_layers": 8}')
    assert self_draft is not None and self_draft.is_self_draft and self_draft.num_speculative_tokens == 4
    assert SpeculativeConfig.parse(ngram) is ngram


@pytest.mark.parametrize(
    "value,message",
    [
        ("{not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ({"num_speculative_tokens": 2}, 'needs "method"'),
        ({"method": "eagle"}, "method must be one of ngram, draft"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\]"),
        ({"method": "ngram", "num_speculative_tokens": 17}, r"in \[1, 16\]"),
        ({"method": "ngram", "num_speculative_tokens": True}, r"in \[1, 16\]"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"),
        ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
        ({"method": "ngram", "model": "x"}, "apply to the draft method only"),
        ({"method": "draft"}, 'needs "model"'),
        ({"method": "draft", "model": "self"}, 'needs "num_layers"'),
        ({"method": "draft", "model": "other", "num_layers": 2}, 'applies to the "self" draft only'),
        ({"method": "ngram", "speculative_tokens": 2}, "unknown speculative config keys: speculative_tokens"),
    ],
)
def test_bad_configs_are_refused_with_the_reason(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)
