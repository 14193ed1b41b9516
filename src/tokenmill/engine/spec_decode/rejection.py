"""Exact verification of draft tokens, inside the sampler.

A request with drafts d_1..d_k was computed by the target on [last token, d_1, ..., d_k],
so the step has k + 1 rows of logits for it: row j is the target's distribution p_j for
the position after d_j (row 0 after the last token). Verification walks the rows in
order: row j's token x_j is sampled from p_j exactly as a step without speculation would
sample it (same processors, penalties, min_tokens and seeded draw, with the history
including the accepted d_1..d_j); if x_j == d_{j+1} the draft is accepted and the walk
goes on, otherwise x_j is the request's last token of the step. After k accepted drafts,
x_k is the bonus token.

This is rejection sampling with a one-hot proposal: accept d with probability p(d), and on
rejection draw from (p - onehot(d))+ renormalised, which is p restricted to the other
tokens. Drawing x ~ p and comparing gives exactly that (P[accept d] = p(d); P[emit x != d]
= p(x)), so the output distribution is the target's, token for token, and greedy rows
(argmax) reproduce decoding without speculation. Every proposer here proposes
deterministic tokens (n-gram lookup, a draft model's argmax), so the one-hot case is the
whole story. A seeded request draws position by position from its (seed, position)
stream, so it even produces the same tokens with and without speculation.

Batch logits processors and the grammar see only verified tokens: each row's token is
recorded into their histories before the next row is processed, and a request whose
grammar ended stops there. When no processor is active and every request is greedy
without penalties, the walk is one argmax over all rows and a comparison.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenmill.engine.logits.pipeline import LogitsProcessorPipeline
from tokenmill.engine.runner.output import LogprobsTensors
from tokenmill.engine.runner.sampling_batch import SamplingBatch


@dataclass
class Verification:
    # Per request: accepted drafts, then the token sampled after them.
    token_ids: list[list[int]]
    # One row per token of token_ids (request order, then token order), or None.
    logprobs: LogprobsTensors | None = None
    stopped: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)


def verify(
    logits: torch.Tensor,
    req_ids: list[str],
    drafts: list[list[int]],
    sampling: SamplingBatch,
    processors: LogitsProcessorPipeline,
) -> Verification:
    """`logits` [sum(1 + len(d)), vocab]: request i's rows follow each other. Records the
    accepted tokens into `sampling` and `processors` as it goes."""
    offsets = [0]
    for d in drafts:
        offsets.append(offsets[-1] + 1 + len(d))
    assert logits.shape[0] == offsets[-1], (logits.shape, offsets[-1])
    if not processors.active and sampling.is_bare_argmax(req_ids):
        return _verify_argmax(logits, req_ids, drafts, offsets, sampling)
    num_reqs = len(req_ids)
    taken: list[list[int]] = [[] for _ in range(num_reqs)]
    alive = list(range(num_reqs))
    result = Verification(taken)
    logprob_steps: list[LogprobsTensors] = []
    logprob_rows: list[list[int]] = [[] for _ in range(num_reqs)]
    process = (lambda x: processors.apply(x, req_ids)) if processors.active else None
    for j in range(max(len(d) for d in drafts) + 1):
        # Every request keeps its row in the batch (finished ones re-score their last row,
        # ignored), so processors and sampling state see the same batch every pass.
        index = torch.tensor([offsets[i] + min(j, len(drafts[i])) for i in range(num_reqs)])
        tokens, logprobs = sampling.sample(logits[index], req_ids, process)
        token_list = tokens.tolist()
        if logprobs is not None:
            logprob_steps.append(logprobs)
        alive_tokens = [token_list[i] for i in alive]
        sampling.append_tokens([req_ids[i] for i in alive], alive_tokens)
        if process is not None:
            stopped, failed = processors.record(alive_tokens, alive)
            result.stopped.update(stopped)
            result.failed.update(failed)
        still = []
        for i in alive:
            token = token_list[i]
            taken[i].append(token)
            if logprobs is not None:
                logprob_rows[i].append(j * num_reqs + i)
            rid = req_ids[i]
            if j < len(drafts[i]) and token == drafts[i][j] and rid not in result.stopped and rid not in result.failed:
                still.append(i)
        alive = still
        if not alive:
            break
    if logprob_steps:
        flat = torch.tensor([r for rows in logprob_rows for r in rows], dtype=torch.int64)
        result.logprobs = LogprobsTensors(
            torch.cat([s.token_ids for s in logprob_steps])[flat],
            torch.cat([s.logprobs for s in logprob_steps])[flat],
            torch.cat([s.ranks for s in logprob_steps])[flat],
        )
    return result


def _verify_argmax(
    logits: torch.Tensor,
    req_ids: list[str],
    drafts: list[list[int]],
    offsets: list[int],
    sampling: SamplingBatch,
) -> Verification:
    targets = logits.argmax(dim=-1).tolist()
    taken: list[list[int]] = []
    for i, d in enumerate(drafts):
        row = targets[offsets[i] : offsets[i + 1]]
        n = 0
        while n < len(d) and row[n] == d[n]:
            n += 1
        taken.append(row[: n + 1])
    sampling.append_tokens(
        [r for r, tokens in zip(req_ids, taken, strict=True) for _ in tokens],
        [t for tokens in taken for t in tokens],
    )
    return Verification(taken)
