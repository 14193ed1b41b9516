"""Workloads: the list of requests a benchmark sends, built up front from a seed.

Three kinds, all deterministic for a given seed so every server sees the same requests:

  * random: each prompt is `input_len` token ids drawn uniformly from the tokenizer's
    non-special ids (or [100, 32000) without a tokenizer), sent as a token-id list to
    /v1/completions, so the server sees exactly that many prompt tokens. For chat the ids
    are decoded to text (which re-tokenizes to about the same length). `input_len` and
    `output_len` are fixed (`256`) or uniform ranges (`128:512`, both ends included).
  * sharegpt: a ShareGPT-format JSON file (a list of {"conversations": [{"from": "human",
    "value": ...}, {"from": "gpt", "value": ...}, ...]}). Each entry gives its first human
    turn as the prompt and the length of the reply that follows as the output length
    (counted with the tokenizer; `output_len` overrides it). As in vLLM's benchmark,
    pairs with a prompt or reply under 4 tokens, a prompt over 1024, or over 2048 tokens
    together are skipped; the rest are shuffled with the seed.
  * multi-turn: conversations over a few long shared system prompts. Conversation c uses
    system prompt c % num_system_prompts; its turn t request holds the system prompt,
    t user questions and the t - 1 assistant replies between them. The replies are
    synthetic text, not the server's answers, so requests are independent and identical
    across servers. Requests go out turn by turn across conversations, so each one shares
    a long prefix (system prompt, then its own history) with requests sent before it:
    what a prefix cache turns into skipped prefill.

Chat workloads send `messages`; for /v1/completions they are flattened to
"role: content" lines joined by blank lines, ending with "assistant:".
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# Token ids for random prompts when no tokenizer says which ids exist.
DEFAULT_ID_RANGE = (100, 32000)
# vLLM's ShareGPT filters, in tokens.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048

# Deterministic filler text for synthetic conversations (about one token per word).
_WORDS = ["the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "by", "at", "this", "are", "from", "or", "have", "an", "they", "which", "one", "you", "were", "all", "we", "her", "she", "there", "can", "their", "has", "been", "if", "more", "when", "will", "would", "who", "so", "no", "time", "about", "many", "then", "them", "these", "some", "could", "other", "into", "only", "new", "people", "water", "way", "day", "long", "little", "down", "first", "find", "use", "work", "part", "over", "make", "number", "sound", "most", "year", "place"]


class TextTokenizer(Protocol):
    """What a workload (and the client's token counting) needs from a tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def special_token_ids(self) -> frozenset[int]: ...


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload, in the forms the two endpoints take."""

    # For /v1/completions: text or token ids. None when only `messages` exist (flattened).
    prompt: str | list[int] | None
    # For /v1/chat/completions. None when the prompt is token ids and no tokenizer decodes them.
    messages: list[dict[str, str]] | None
    # max_tokens of the request.
    output_len: int
    # Prompt tokens as built; None when unknown until the server's usage says.
    prompt_len: int | None

    def completion_prompt(self) -> str | list[int]:
        if self.prompt is not None:
            return self.prompt
        assert self.messages is not None  # __post_init__ guarantees one of the two
        return flatten_messages(self.messages)

    def chat_messages(self) -> list[dict[str, str]]:
        if self.messages is None:
            raise ValueError(
                "this workload's prompts are token ids; the chat endpoint needs text: "
                "pass a tokenizer (--tokenizer) or use --endpoint completions"
            )
        return self.messages

    def __post_init__(self) -> None:
        if self.prompt is None and self.messages is None:
            raise ValueError("a request needs a prompt or messages")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


@dataclass(frozen=True)
class LengthRange:
    """A token length: fixed (low == high) or uniform over [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """'256' or '128:512'."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"a length is N or LOW:HIGH, got {text!r}") from None
        if len(values) not in (1, 2):
            raise ValueError(f"a length is N or LOW:HIGH, got {text!r}")
        return cls(values[0], values[-1])

    def sample(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"a length range needs 1 <= low <= high, got {self.low}:{self.high}")


def random_requests(
    num: int,
    input_len: LengthRange,
    output_len: LengthRange,
    seed: int,
    tokenizer: TextTokenizer | None = None,
) -> list[BenchRequest]:
    rng = random.Random(seed)
    if tokenizer is not None:
        special = tokenizer.special_token_ids
        ids = [i for i in range(tokenizer.vocab_size) if i not in special]
    else:
        ids = list(range(*DEFAULT_ID_RANGE))
    requests: list[BenchRequest] = []
    for _ in range(num):
        prompt = [rng.choice(ids) for _ in range(input_len.sample(rng))]
        messages = None
        if tokenizer is not None:
            messages = [{"role": "user", "content": tokenizer.decode(prompt)}]
        requests.append(BenchRequest(prompt, messages, output_len.sample(rng), len(prompt)))
    return requests


def sharegpt_requests(
    path: str | Path,
    num: int,
    seed: int,
    tokenizer: TextTokenizer | None = None,
    output_len: int | None = None,
) -> list[BenchRequest]:
    if tokenizer is None and output_len is None:
        raise ValueError("a ShareGPT workload needs a tokenizer or a fixed output length")
    pairs = _sharegpt_pairs(Path(path))
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(requests) == num:
            break
        prompt_len = reply_len = None
        if tokenizer is not None:
            prompt_len = len(tokenizer.encode(prompt))
            reply_len = len(tokenizer.encode(reply))
            too_short = prompt_len < SHAREGPT_MIN_LEN or reply_len < SHAREGPT_MIN_LEN
            too_long = (
                prompt_len > SHAREGPT_MAX_PROMPT_LEN
                or prompt_len + reply_len > SHAREGPT_MAX_TOTAL_LEN
            )
            if too_short or too_long:
                continue
        max_tokens = output_len if output_len is not None else reply_len
        assert max_tokens is not None
        requests.append(
            BenchRequest(prompt, [{"role": "user", "content": prompt}], max_tokens, prompt_len)
        )
    if len(requests) < num:
        raise ValueError(f"{path} has {len(requests)} usable conversations, {num} were asked for")
    return requests


def multi_turn_requests(
    num: int,
    output_len: int,
    seed: int,
    num_system_prompts: int = 4,
    system_prompt_len: int = 512,
    num_turns: int = 4,
    turn_len: int = 32,
    tokenizer: TextTokenizer | None = None,
) -> list[BenchRequest]:
    """`num` requests: ceil(num / num_turns) conversations, sent turn by turn."""
    for name, value in (
        ("num_system_prompts", num_system_prompts),
        ("system_prompt_len", system_prompt_len),
        ("num_turns", num_turns),
        ("turn_len", turn_len),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)

    def text(num_words: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(num_words))

    systems = [text(system_prompt_len) for _ in range(num_system_prompts)]
    num_conversations = math.ceil(num / num_turns)
    # turns[c][t]: (question, synthetic reply) of conversation c's turn t
    turns = [[(text(turn_len), text(turn_len)) for _ in range(num_turns)] for _ in range(num_conversations)]
    requests: list[BenchRequest] = []
    for t in range(num_turns):
        for c in range(num_conversations):
            if len(requests) == num:
                break
            messages = [{"role": "system", "content": systems[c % num_system_prompts]}]
            for question, reply in turns[c][:t]:
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
            messages.append({"role": "user", "content": turns[c][t][0]})
            prompt_len = None
            if tokenizer is not None:
                prompt_len = len(tokenizer.encode(flatten_messages(messages)))
            requests.append(BenchRequest(None, messages, output_len, prompt_len))
    return requests


def flatten_messages(messages: Sequence[dict[str, str]]) -> str:
    """Chat messages as one completion prompt."""
    return "\n\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\n\nassistant:"


def _sharegpt_pairs(path: Path) -> list[tuple[str, str]]:
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"ShareGPT file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations", entry.get("conversation")) if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = turns[0], turns[1]
        if not (isinstance(first, dict) and isinstance(second, dict)):
            continue
        if first.get("from") in ("human", "user") and second.get("from") in ("gpt", "assistant"):
            pairs.append((str(first.get("value", "")), str(second.get("value", ""))))
    return pairs
