"""Engine logprobs -> the two API formats.

The engine gives, per position, `{token_id: Logprob(logprob, rank, decoded_token)}`: the
chosen token plus the top-k alternatives (rank 1 = most likely).

- Chat (`choices[].logprobs.content[]`): one entry per generated token with its text,
  logprob and UTF-8 bytes, and `top_logprobs` = exactly the k best (the chosen token is in
  it only when it ranks within k).
- Completions (parallel lists `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`):
  `top_logprobs` maps text -> logprob for the k best *plus* the chosen token (up to k+1
  entries, as the legacy API documents); `text_offset` is each token's character offset
  in the returned text. Echoed prompt tokens come first; the very first prompt token has
  no logprob (null).

Token bytes: a byte-level BPE token may be a fragment of a UTF-8 character, which decodes
to U+FFFD. Its true bytes come from the byte-level alphabet (GPT-2's bytes_to_unicode);
for other tokenizers the UTF-8 of the decoded text is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from tokenmill.engine.loader.tokenizer import Tokenizer
from tokenmill.engine.outputs import Logprob, PositionLogprobs
from tokenmill.server.responses import ChatTokenLogprob, CompletionLogprobs, TopLogprob


class LogprobFormatter:
    """Logprobs in OpenAI's shapes. Generated special tokens (EOS, <|im_end|>) are left out
    when the request skips special tokens, as their text is: the tokens listed always
    concatenate to the returned text, and no stop token ever shows."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._hidden = tokenizer.special_token_ids if skip_special_tokens else frozenset()

    def token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        if "\ufffd" in text:
            piece = self._tokenizer.convert_ids_to_tokens([token_id])[0]
            decoded = _byte_level_bytes(piece)
            if decoded is not None:
                return list(decoded)
        return list(text.encode("utf-8"))

    def chat(
        self, token_ids: Sequence[int], positions: Sequence[PositionLogprobs], k: int
    ) -> list[ChatTokenLogprob]:
        entries = []
        for token_id, position in zip(token_ids, positions, strict=True):
            if token_id in self._hidden:
                continue
            chosen = position.get(token_id)
            text = self.token_text(token_id, chosen)
            top = [
                TopLogprob(token=t, logprob=lp.logprob, bytes=self.token_bytes(tid, t))
                for tid, lp in _top(position, k)
                for t in (self.token_text(tid, lp),)
            ]
            entries.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=_finite(chosen.logprob if chosen else float("-inf")),
                    bytes=self.token_bytes(token_id, text),
                    top_logprobs=top,
                )
            )
        return entries

    def completion(
        self,
        token_ids: Sequence[int],
        positions: Sequence[PositionLogprobs | None],
        k: int,
        text_offset: int,
        *,
        generated: bool = True,
    ) -> CompletionLogprobs:
        """`text_offset` is where the first of these tokens starts in the choice's text;
        `generated` False for echoed prompt tokens (their special tokens stay in the text)."""
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        offset = text_offset
        hidden = self._hidden if generated else frozenset()
        for token_id, position in zip(token_ids, positions, strict=True):
            if token_id in hidden:
                continue
            chosen = position.get(token_id) if position is not None else None
            text = self.token_text(token_id, chosen)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if position is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(chosen.logprob) if chosen else None)
            top = {self.token_text(tid, lp): _finite(lp.logprob) for tid, lp in _top(position, k)}
            if chosen is not None:
                top.setdefault(text, _finite(chosen.logprob))
            out.top_logprobs.append(top)
        return out


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, Logprob]]:
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [(tid, lp) for tid, lp in ranked if lp.rank <= k][:k]


def _finite(value: float) -> float:
    """JSON has no -inf; OpenAI reports impossible tokens as -9999.0."""
    return max(value, -9999.0)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable-unicode map, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _byte_level_bytes(piece: str | None) -> bytes | None:
    decoder = _byte_decoder()
    if not piece or any(ch not in decoder for ch in piece):
        return None
    return bytes(decoder[ch] for ch in piece)
