import random

import pytest

from tokenmill.engine.stop_checker import StopChecker


def feed(checker: StopChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    """Append deltas until a stop string fires; return the streamed pieces and the stop."""
    streamed = []
    stop = None
    for delta in deltas:
        stop = checker.append(delta)
        streamed.append(checker.take_stream_delta(final=stop is not None))
        if stop is not None:
            break
    else:
        streamed.append(checker.take_stream_delta(final=True))
    return streamed, stop


def test_stop_string_spanning_deltas():
    checker = StopChecker(["o w"])
    streamed, stop = feed(checker, ["Hel", "lo", " wo", "rld"])
    assert stop == "o w" and checker.text == "Hell" and "".join(streamed) == "Hell"
    assert streamed == ["Hel", "l", ""]  # "o" held back: it could start "o w"


def test_stop_string_at_the_very_start():
    checker = StopChecker(["Hi"])
    assert feed(checker, ["Hi there"]) == ([""], "Hi")
    assert checker.text == ""


def test_the_stop_string_that_ends_first_wins():
    checker = StopChecker(["abcd", "bc"])
    assert checker.append("xabcdy") == "bc" and checker.text == "xa"
    # Same end: the one that starts first.
    checker = StopChecker(["bc", "abc"])
    assert checker.append("xabcdy") == "abc" and checker.text == "x"


@pytest.mark.parametrize("stops", [["abcd", "bc"], ["bc", "abc"], ["ab", "b", "abcdy"]])
def test_result_does_not_depend_on_how_text_is_split(stops):
    whole = StopChecker(stops)
    whole.append("xabcdy")
    chars = StopChecker(stops)
    streamed, stop = feed(chars, list("xabcdy"))
    assert (chars.text, stop) == (whole.text, whole.stop_reason)
    assert "".join(streamed) == whole.text


def test_include_stop_str_in_output_keeps_it_and_drops_what_follows():
    checker = StopChecker(["STOP"], include_stop_str_in_output=True)
    streamed, stop = feed(checker, ["go S", "TOP and", " more"])
    assert stop == "STOP" and checker.text == "go STOP"
    assert streamed == ["go S", "TOP"]  # no hold-back needed


def test_hold_back_releases_text_that_turns_out_not_to_stop():
    checker = StopChecker(["STOP", "END"])
    assert checker.append("Hello S") is None
    assert checker.take_stream_delta() == "Hello "
    assert checker.append("TO") is None
    assert checker.take_stream_delta() == ""  # "STO" held
    assert checker.append("RM E") is None
    assert checker.take_stream_delta() == "STORM "  # "E" could start "END"
    assert checker.take_stream_delta(final=True) == "E"
    assert checker.text == "Hello STORM E"


def test_matching_can_be_deferred():
    checker = StopChecker(["ab"])
    assert checker.append("ab", check=False) is None
    assert checker.append("cab") == "ab" and checker.text == "abc"


def test_no_stop_strings_streams_everything():
    checker = StopChecker([])
    assert feed(checker, ["a", "b"]) == (["a", "b", ""], None)


def test_random_splits_never_leak_a_stop_string():
    rng = random.Random(0)
    alphabet = "abST P"
    for _ in range(300):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(2)]
        text = "".join(rng.choice(alphabet) for _ in range(30))
        cuts = sorted(rng.sample(range(1, 30), 6))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, 30], strict=True)]
        checker = StopChecker(stops)
        streamed, stop = feed(checker, deltas)
        earliest = min(
            ((text.find(s) + len(s), text.find(s), s) for s in stops if s in text), default=None
        )
        expected = text if earliest is None else text[: earliest[1]]
        assert checker.text == expected and "".join(streamed) == expected
        assert stop == (None if earliest is None else earliest[2])
        assert all(s not in expected for s in stops)
