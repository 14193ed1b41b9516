"""Stop strings over one request's growing output text, and what is safe to stream.

After each text delta the checker looks for stop strings that end inside the new text
(an occurrence may start in earlier text: a stop string can span tokens). When several
complete in the same delta, the one that ends first wins (then the one that starts
first): that is the one a character-by-character stream would have hit first, so the
result does not depend on how the text was split into tokens. The text is cut before the
stop string, or after it with include_stop_str_in_output, and anything past it dropped.

While streaming, the tail of the text that could still become the start of a stop string
is held back: the longest suffix that is a proper prefix of some stop string. It is
released once the text moves past it, and at the end. So a stop string never leaks into
streamed text, and the streamed deltas concatenate to exactly the final text. (With
include_stop_str_in_output nothing needs holding back: every character before a stop
string's end is output anyway.)
"""

from __future__ import annotations


class StopChecker:
    """Output text of one request, cut at the first stop string."""

    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in dict.fromkeys(stop) if s]
        self._include = include_stop_str_in_output
        self._max_hold = (
            0 if include_stop_str_in_output else max((len(s) - 1 for s in self._stops), default=0)
        )
        self.text = ""
        # The stop string that ended the text, once one has.
        self.stop_reason: str | None = None
        self._num_streamed = 0

    def append(self, delta: str, check: bool = True) -> str | None:
        """Add decoded text; return the stop string if one completed in it (the text is then
        final). `check=False` appends without matching (min_tokens not reached yet)."""
        assert self.stop_reason is None, "text already ended at a stop string"
        start = len(self.text)
        self.text += delta
        if not (check and delta and self._stops):
            return None
        best: tuple[int, int, str] | None = None  # (end, begin, stop)
        for stop in self._stops:
            begin = self.text.find(stop, max(0, start - len(stop) + 1))
            if begin < 0:
                continue
            candidate = (begin + len(stop), begin, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        if best is None:
            return None
        end, begin, stop = best
        self.text = self.text[: end if self._include else begin]
        self.stop_reason = stop
        return stop

    def take_stream_delta(self, final: bool = False) -> str:
        """The text not streamed yet, less the held-back tail (none when `final` or once a
        stop string matched)."""
        upto = len(self.text)
        if not final and self.stop_reason is None:
            upto -= self._held_back_length()
        upto = max(upto, self._num_streamed)
        delta = self.text[self._num_streamed : upto]
        self._num_streamed = upto
        return delta

    def _held_back_length(self) -> int:
        """Longest suffix of the text that is a proper prefix of a stop string."""
        text = self.text
        for length in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-length:]
            if any(len(s) > length and s.startswith(tail) for s in self._stops):
                return length
        return 0
