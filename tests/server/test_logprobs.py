"""LogprobFormatter: top-k selection by rank, bytes of byte-level fragments."""

from __future__ import annotations

from fake_engine import FakeTokenizer

from tokenmill.engine.outputs import Logprob
from tokenmill.server.logprobs import LogprobFormatter


class ByteLevelTokenizer(FakeTokenizer):
    """Token 300 is "é"'s first byte alone, spelled in GPT-2's byte alphabet ("Ã")."""

    def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
        return "\ufffd" if list(ids) == [300] else super().decode(ids, skip_special_tokens)

    def convert_ids_to_tokens(self, ids):  # type: ignore[no-untyped-def]
        return ["Ã" if i == 300 else super().convert_ids_to_tokens([i])[0] for i in ids]


def test_chat_top_logprobs_are_exactly_the_k_best() -> None:
    formatter = LogprobFormatter(FakeTokenizer())
    # The sampled token ("c") ranks 3rd: it is reported, but is not in a top-2 list.
    position = {99: Logprob(-2.0, 3), 97: Logprob(-0.1, 1), 98: Logprob(-1.0, 2)}
    (entry,) = formatter.chat([99], [position], 2)
    assert (entry.token, entry.logprob, entry.bytes) == ("c", -2.0, [99])
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [("a", -0.1), ("b", -1.0)]
    (entry,) = formatter.chat([99], [position], 0)
    assert entry.top_logprobs == []


def test_completion_top_logprobs_add_the_chosen_token() -> None:
    formatter = LogprobFormatter(FakeTokenizer())
    position = {99: Logprob(-2.0, 3), 97: Logprob(-0.1, 1), 98: Logprob(-1.0, 2)}
    out = formatter.completion([97, 99], [None, position], 1, text_offset=5)
    assert out.tokens == ["a", "c"]
    assert out.token_logprobs == [None, -2.0]
    assert out.top_logprobs == [None, {"a": -0.1, "c": -2.0}]
    assert out.text_offset == [5, 6]


def test_impossible_tokens_are_finite() -> None:
    formatter = LogprobFormatter(FakeTokenizer())
    (entry,) = formatter.chat([97], [{97: Logprob(float("-inf"), 1)}], 1)
    assert entry.logprob == -9999.0


def test_fragment_bytes_come_from_the_byte_alphabet() -> None:
    formatter = LogprobFormatter(ByteLevelTokenizer())
    (entry,) = formatter.chat([300], [{300: Logprob(-0.5, 1)}], 0)
    assert entry.token == "\ufffd"
    assert entry.bytes == [0xC3]
