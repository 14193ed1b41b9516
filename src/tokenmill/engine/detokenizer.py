"""Incremental detokenization: appended token ids -> text deltas, one request at a time.

Byte-level BPE splits one character across tokens (an emoji is often 2-4 tokens, each
carrying some of its UTF-8 bytes), so decoding tokens one by one would emit U+FFFD for
the partial bytes. `tokenizers.decoders.DecodeStream` keeps a window of pending ids and
emits text only once it decodes to complete characters: the concatenated deltas equal
decoding the whole sequence at once. The stream is primed with the last few prompt
tokens so that decoders that treat the start of a text specially (a SentencePiece
leading space, for one) decode the first generated token as a continuation. A prompt
that ends mid-character leaves its partial tokens pending in the stream, so the
character the output completes is emitted whole (with whatever else those prompt tokens
spell, such as a leading space).
"""

from __future__ import annotations

from typing import Protocol

import tokenizers
from tokenizers.decoders import DecodeStream

# Prompt tokens that prime the stream: enough context for any decoder's start rule and
# for a character the prompt leaves half-finished.
_PROMPT_CONTEXT_TOKENS = 6


class TokenizerLike(Protocol):
    """The slice of tokenmill's Tokenizer that detokenization uses."""

    @property
    def backend(self) -> tokenizers.Tokenizer: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas, token by token."""

    def __init__(
        self,
        tokenizer: TokenizerLike,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._backend = tokenizer.backend
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # Tokens of a character the prompt leaves unfinished go in as pending, not context.
        num_pending = 0
        while num_pending < len(context) and self._backend.decode(
            context[: len(context) - num_pending], skip_special_tokens=skip_special_tokens
        ).endswith("\ufffd"):
            num_pending += 1
        split = len(context) - num_pending
        self._stream = DecodeStream(
            ids=context[:split] or None, skip_special_tokens=skip_special_tokens
        )
        for token_id in context[split:]:
            self._stream.step(self._backend, token_id)
        self.num_tokens = 0

    def decode_next(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is split
        across tokens, or for a skipped special token)."""
        self.num_tokens += 1
        return self._stream.step(self._backend, token_id) or ""

    def decode(self, token_ids: list[int]) -> str:
        """Append several tokens; return the text they complete."""
        return "".join(self.decode_next(t) for t in token_ids)
