"""Batched sampling over persistent per-row sampling state.

Each request in the runner's batch owns one row of preallocated state: its scalar knobs
(one row of a CPU table, copied to the device once per batch composition), its logit
biases and min_tokens stop ids (padded per-row tensors), and, when it uses penalties,
the distinct tokens it has seen (SeenTokens, kept current by `append_tokens`). A step
then runs one batched pass over `logits [n, vocab]`:

    raw logprobs (log_softmax of the unmodified logits, when any row asked)
    logit_bias -> min_tokens mask -> repetition penalty -> presence/frequency penalties
    greedy rows: argmax of the processed logits (exact)
    others: softmax(logits / temperature) -> top_k -> top_p -> min_p -> inverse-CDF draw

top_k, top_p and min_p all reduce to one probability threshold per row, found on the
row's largest probabilities (one `topk`, widened only for rows whose top_p mass lies
further out) instead of a full vocabulary sort; tokens below it get p = 0.

Each row then draws a single uniform u and takes the first token whose cumulative
probability (float64) exceeds u * total: token i wins with probability p_i / total, with
no renormalisation and no per-token noise. (The exponential race argmax(p / q) needs a
[n, vocab] noise tensor: 66 ms at 64 x 49152 on the 2-core CPU, against ~3 ms for the
cumulative sum.) Unseeded rows share one batched draw. A seeded row draws from a
generator reseeded with hash(seed, number of tokens it has generated): its draw is a pure
function of (seed, position), so the same seed gives the same tokens whatever else is in
the batch, and a request resumed after preemption continues exactly where it left off.

Which stages run is decided once per batch composition from the CPU table (no device
sync): an all-greedy batch without penalties, biases, min_tokens or logprobs is a bare
argmax, and the top-k/top-p search is skipped when no row needs it. The only per-row
Python work in `sample()` is the seeded rows' generator draws (plus mapping req_ids to
rows when the batch composition changed).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.engine.request import SamplingParams
from tokenmill.engine.runner.output import LogprobsTensors
from tokenmill.engine.runner.seen_tokens import SeenTokens
from tokenmill.engine.runner.truncation import top_k_top_p_threshold

# Columns of the per-row CPU table of scalar knobs.
_TEMPERATURE, _GREEDY, _TOP_K, _TOP_P, _MIN_P = 0, 1, 2, 3, 4
_PRESENCE, _FREQUENCY, _REPETITION, _MIN_TOKENS = 5, 6, 7, 8
_LOGPROBS_K, _SEEDED, _HAS_BIAS = 9, 10, 11
_NUM_COLUMNS = 12

_MASK64 = (1 << 64) - 1
# Tokens per block of the two-level inverse CDF.
_CDF_BLOCK = 1024


@dataclass
class _StepView:
    """What one batch composition (req_ids in order) needs, gathered once and reused."""

    req_ids: list[str]
    rows_cpu: torch.Tensor  # [n] int64
    rows: torch.Tensor | slice  # device index into the row tensors (a slice when 0..n-1)
    params: torch.Tensor  # [n, _NUM_COLUMNS] float32 on the device
    top_k: torch.Tensor  # [n] int64 on the device (vocab_size when disabled)
    top_p: torch.Tensor  # [n] float32 on the device
    min_tokens: torch.Tensor  # [n] int64 on the CPU
    all_greedy: bool
    any_greedy: bool
    max_top_k: int  # largest enabled top_k, 0 when none
    any_top_p: bool
    any_min_p: bool
    any_repetition: bool
    any_frequency_presence: bool
    any_min_tokens: bool
    any_bias: bool
    max_logprobs: int | None
    # (position in req_ids, row, seed) of each seeded non-greedy row.
    seeded: list[tuple[int, int, int]]

    @property
    def bare_argmax(self) -> bool:
        return self.all_greedy and not (
            self.any_repetition
            or self.any_frequency_presence
            or self.any_min_tokens
            or self.any_bias
            or self.max_logprobs is not None
        )


class SamplingBatch:
    """Sampling state of up to `max_num_seqs` requests and the batched sampler over it."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._row_of: dict[str, int] = {}
        self._seed_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_seqs))
        self._table = torch.zeros(max_num_seqs, _NUM_COLUMNS, dtype=torch.float64)
        # Tokens each row has generated (CPU: read for min_tokens and seed keys).
        self._num_output = torch.zeros(max_num_seqs, dtype=torch.int64)
        # Padded per-row logit biases and min_tokens stop ids (widths grow on demand).
        self._bias_ids = torch.zeros(max_num_seqs, 0, dtype=torch.int64, device=self.device)
        self._bias_values = torch.zeros(max_num_seqs, 0, dtype=torch.float32, device=self.device)
        self._stop_ids = torch.zeros(max_num_seqs, 0, dtype=torch.int64, device=self.device)
        self._stop_valid = torch.zeros(max_num_seqs, 0, dtype=torch.bool, device=self.device)
        self._seen = SeenTokens(max_num_seqs, self.device)
        self._generator = torch.Generator(device=self.device)
        self._version = 0
        self._view: _StepView | None = None
        self._view_version = -1

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._row_of

    def __len__(self) -> int:
        return len(self._row_of)

    # ------------------------------------------------------------------ membership
    def add(
        self,
        req_id: str,
        params: SamplingParams,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        eos_token_ids: tuple[int, ...],
    ) -> None:
        """Give a request a row. A resumed request brings the tokens it generated so far."""
        assert req_id not in self._row_of, f"{req_id} is already in the sampling batch"
        if not self._free_rows:
            raise RuntimeError(f"sampling batch is full ({self.max_num_seqs} rows)")
        bias = params.logit_bias or {}
        bad = [t for t in bias if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias token ids {bad} are outside the vocabulary ({self.vocab_size})"
            )
        row = heapq.heappop(self._free_rows)
        self._row_of[req_id] = row
        greedy = params.greedy
        seeded = params.seed is not None and not greedy
        if params.seed is not None and not greedy:
            self._seed_of[req_id] = params.seed
        top_k = self.vocab_size if params.top_k is None else min(params.top_k, self.vocab_size)
        logprobs_k = -1 if params.logprobs is None else min(params.logprobs, self.vocab_size)
        self._table[row] = torch.tensor(
            [
                1.0 if greedy else params.temperature,
                float(greedy),
                float(top_k),
                params.top_p,
                params.min_p,
                params.presence_penalty,
                params.frequency_penalty,
                params.repetition_penalty,
                float(params.min_tokens),
                float(logprobs_k),
                float(seeded),
                float(bool(bias)),
            ],
            dtype=torch.float64,
        )
        self._num_output[row] = len(output_token_ids)
        self._set_bias(row, bias)
        # min_tokens holds back eos (unless ignored) and the stop token ids. Ids outside the
        # vocabulary can never be sampled, so there is nothing to hold back for them.
        stops = [*([] if params.ignore_eos else eos_token_ids), *params.stop_token_ids]
        needs_stops = params.min_tokens > len(output_token_ids)
        self._set_stop_ids(
            row, sorted({t for t in stops if t < self.vocab_size}) if needs_stops else []
        )
        uses_penalties = (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
        )
        if uses_penalties:
            self._seen.set_row(row, prompt_token_ids, output_token_ids)
        self._version += 1

    def remove(self, req_id: str) -> None:
        """Free a request's row (`add` rewrites all of a row's state)."""
        row = self._row_of.pop(req_id)
        self._seen.clear_row(row)
        self._seed_of.pop(req_id, None)
        heapq.heappush(self._free_rows, row)
        self._version += 1

    def append_tokens(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Record the tokens sampled this step (must follow every `sample`)."""
        row_list = [self._row_of[r] for r in req_ids]
        rows = torch.tensor(row_list, dtype=torch.int64)
        self._num_output.index_add_(0, rows, torch.ones_like(rows))
        self._seen.append(row_list, token_ids)

    def _set_bias(self, row: int, bias: dict[int, float]) -> None:
        if len(bias) > self._bias_ids.shape[1]:
            self._bias_ids = _widen(self._bias_ids, len(bias), 0)
            self._bias_values = _widen(self._bias_values, len(bias), 0.0)
        # Padding adds 0.0 to token 0: a no-op.
        self._bias_ids[row].zero_()
        self._bias_values[row].zero_()
        if bias:
            n = len(bias)
            self._bias_ids[row, :n] = torch.tensor(list(bias.keys()), dtype=torch.int64)
            self._bias_values[row, :n] = torch.tensor(list(bias.values()), dtype=torch.float32)

    def _set_stop_ids(self, row: int, stop_ids: list[int]) -> None:
        if len(stop_ids) > self._stop_ids.shape[1]:
            self._stop_ids = _widen(self._stop_ids, len(stop_ids), 0)
            self._stop_valid = _widen(self._stop_valid, len(stop_ids), False)
        self._stop_ids[row].zero_()
        self._stop_valid[row].fill_(False)
        if stop_ids:
            n = len(stop_ids)
            self._stop_ids[row, :n] = torch.tensor(stop_ids, dtype=torch.int64)
            self._stop_valid[row, :n] = True

    # ------------------------------------------------------------------ sampling
    def sample(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        processors: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, LogprobsTensors | None]:
        """Sample one token per row. `logits` [n, vocab] (row i is req_ids[i]) is consumed:
        it may be modified in place. `processors` (the batch logits processors, grammar
        masks among them) transform the float32 logits first; logprobs are those of the
        raw distribution, before any processing (as vLLM reports them).

        Returns the tokens (int64 [n]) and, when any row asked for logprobs, LogprobsTensors
        with k = the largest number asked for in this call: a row that asked for fewer (or
        none) carries extra columns that the caller trims to its own request.
        """
        # logits: [n, vocab]
        assert logits.shape == (len(req_ids), self.vocab_size), (logits.shape, len(req_ids))
        if logits.dtype != torch.float32:
            logits = logits.float()
        view = self._step_view(req_ids)
        raw_logprobs = None
        if view.max_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if processors is not None:
            logits = processors(logits)
        if view.bare_argmax:
            return logits.argmax(dim=-1), None
        logits = self._process_logits(logits, view)
        if view.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            greedy_tokens = logits.argmax(dim=-1) if view.any_greedy else None
            tokens = self._draw(self._truncated_probs(logits, view), view)
            if greedy_tokens is not None:
                tokens = torch.where(view.params[:, _GREEDY] > 0, greedy_tokens, tokens)
        if raw_logprobs is None:
            return tokens, None
        assert view.max_logprobs is not None
        return tokens, _logprobs_of(raw_logprobs, tokens, view.max_logprobs)

    def wants_logprobs(self, req_ids: list[str]) -> bool:
        """Whether any of these rows reports logprobs."""
        return self._step_view(req_ids).max_logprobs is not None

    def is_bare_argmax(self, req_ids: list[str]) -> bool:
        """Whether `sample` over these rows is a plain argmax of the logits."""
        return self._step_view(req_ids).bare_argmax

    def probs(self, logits: torch.Tensor, req_ids: list[str]) -> torch.Tensor:
        """The distribution each row of `sample` draws from at this step ([n, vocab],
        rows sum to 1; a greedy row is one-hot at its argmax). Draws nothing and advances
        nothing; `logits` is consumed as in `sample`. For rejection sampling and tests."""
        # logits: [n, vocab]
        assert logits.shape == (len(req_ids), self.vocab_size), (logits.shape, len(req_ids))
        view = self._step_view(req_ids)
        logits = self._process_logits(logits.float(), view)
        one_hot = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        if view.all_greedy:
            return one_hot
        probs = self._truncated_probs(logits, view)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.where(view.params[:, _GREEDY : _GREEDY + 1] > 0, one_hot, probs)

    def compute_prompt_logprobs(
        self, logits: torch.Tensor, target_token_ids: torch.Tensor, k: int
    ) -> LogprobsTensors:
        """Logprobs of each target token under the raw distribution, plus the top k."""
        # logits: [n, vocab], target_token_ids: [n]
        raw = torch.log_softmax(logits.float(), dim=-1)
        return _logprobs_of(
            raw, target_token_ids.to(raw.device, torch.int64), min(k, self.vocab_size)
        )

    def _process_logits(self, logits: torch.Tensor, view: _StepView) -> torch.Tensor:
        """logit_bias, min_tokens and penalties: the stages that change the argmax."""
        rows = view.rows
        if view.any_bias:
            logits.scatter_add_(1, self._bias_ids[rows], self._bias_values[rows])
        if view.any_min_tokens:
            active = self._num_output[view.rows_cpu] < view.min_tokens
            if bool(active.any()):
                blocked = self._stop_valid[rows] & active.to(self.device)[:, None]
                fill = torch.zeros(blocked.shape, dtype=logits.dtype, device=logits.device)
                logits.scatter_add_(
                    1, self._stop_ids[rows], fill.masked_fill_(blocked, float("-inf"))
                )
        if view.any_repetition or view.any_frequency_presence:
            params = view.params
            repetition = params[:, _REPETITION : _REPETITION + 1]
            frequency = params[:, _FREQUENCY : _FREQUENCY + 1]
            presence = params[:, _PRESENCE : _PRESENCE + 1]
            fp = view.any_frequency_presence
            self._seen.apply_penalties(
                logits,
                rows,
                repetition if view.any_repetition else None,
                frequency if fp else None,
                presence if fp else None,
            )
        return logits

    def _truncated_probs(self, logits: torch.Tensor, view: _StepView) -> torch.Tensor:
        """softmax(logits / temperature) with the tokens below each row's top_k / top_p /
        min_p threshold set to 0 (not renormalised)."""
        # Greedy rows carry temperature 1.0: their draw is replaced by their argmax.
        probs = logits.div_(view.params[:, _TEMPERATURE : _TEMPERATURE + 1]).softmax(dim=-1)
        threshold = None
        if view.max_top_k or view.any_top_p:
            threshold = top_k_top_p_threshold(
                probs, view.top_k, view.top_p, view.max_top_k, view.any_top_p
            )
        if view.any_min_p:
            # min_p keeps p >= min_p * p_max: a ratio, unchanged by top-k/top-p renormalisation.
            min_p = view.params[:, _MIN_P] * probs.amax(dim=-1)
            threshold = min_p if threshold is None else torch.maximum(threshold, min_p)
        if threshold is not None:
            probs.masked_fill_(probs < threshold[:, None], 0.0)
        return probs

    def _draw(self, probs: torch.Tensor, view: _StepView) -> torch.Tensor:
        """Inverse CDF: the first token whose cumulative probability exceeds u * total."""
        # probs: [n, vocab] >= 0, each row with some mass
        n = probs.shape[0]
        u = torch.rand(n, dtype=torch.float64, device=self.device)
        if view.seeded:
            rows = torch.tensor([row for _, row, _ in view.seeded], dtype=torch.int64)
            positions = self._num_output[rows].tolist()
            for (i, _, seed), position in zip(view.seeded, positions, strict=True):
                self._generator.manual_seed(_noise_key(seed, position))
                u[i] = torch.rand(
                    1, dtype=torch.float64, generator=self._generator, device=self.device
                )[0]
        return _inverse_cdf(probs, u)

    def _step_view(self, req_ids: list[str]) -> _StepView:
        view = self._view
        if view is not None and self._view_version == self._version and view.req_ids == req_ids:
            return view
        row_list = [self._row_of[r] for r in req_ids]
        n = len(row_list)
        rows_cpu = torch.tensor(row_list, dtype=torch.int64)
        table = self._table[rows_cpu]  # [n, _NUM_COLUMNS] float64
        top_k = table[:, _TOP_K]
        top_k_enabled = top_k < self.vocab_size
        greedy = table[:, _GREEDY] > 0
        flags = torch.stack(
            [
                greedy.all(),
                greedy.any(),
                (table[:, _TOP_P] < 1.0).any(),
                (table[:, _MIN_P] > 0.0).any(),
                (table[:, _REPETITION] != 1.0).any(),
                ((table[:, _FREQUENCY] != 0.0) | (table[:, _PRESENCE] != 0.0)).any(),
                (table[:, _MIN_TOKENS] > 0).any(),
                (table[:, _HAS_BIAS] > 0).any(),
            ]
        ).tolist()
        max_logprobs = int(table[:, _LOGPROBS_K].max()) if n else -1
        max_top_k = int(torch.where(top_k_enabled, top_k, 0).max()) if n else 0
        seeded_positions = torch.nonzero(table[:, _SEEDED] > 0).flatten().tolist()
        contiguous = row_list == list(range(n))
        view = _StepView(
            req_ids=list(req_ids),
            rows_cpu=rows_cpu,
            rows=slice(0, n) if contiguous else rows_cpu.to(self.device),
            params=table.to(torch.float32).to(self.device),
            top_k=top_k.to(torch.int64).to(self.device),
            top_p=table[:, _TOP_P].to(torch.float32).to(self.device),
            min_tokens=table[:, _MIN_TOKENS].to(torch.int64),
            all_greedy=flags[0],
            any_greedy=flags[1],
            max_top_k=max_top_k,
            any_top_p=flags[2],
            any_min_p=flags[3],
            any_repetition=flags[4],
            any_frequency_presence=flags[5],
            any_min_tokens=flags[6],
            any_bias=flags[7],
            max_logprobs=None if max_logprobs < 0 else max_logprobs,
            seeded=[(i, row_list[i], self._seed_of[req_ids[i]]) for i in seeded_positions],
        )
        self._view, self._view_version = view, self._version
        return view


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u * total, in two
    levels: blocks of _CDF_BLOCK tokens (the row's block sums, float64 cumulative), then
    the tokens of the chosen block. One pass over the vocabulary, and float64 where the
    cumulative sums are taken, so tiny probabilities keep their weight."""
    # probs: [n, vocab] >= 0; u: [n] float64 in [0, 1)
    n, vocab = probs.shape
    num_full = vocab // _CDF_BLOCK
    sums = [probs[:, : num_full * _CDF_BLOCK].reshape(n, num_full, _CDF_BLOCK).sum(dim=-1)]
    if vocab % _CDF_BLOCK:
        sums.append(probs[:, num_full * _CDF_BLOCK :].sum(dim=-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=1).double().cumsum(dim=-1)  # [n, num_blocks]
    total = block_cdf[:, -1]
    # u < 1, but u * total may round up to total: stay strictly below it.
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    block = torch.searchsorted(block_cdf, target[:, None], right=True)  # [n, 1]
    block = block.clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=probs.device)  # [n, B]
    inside = columns < vocab
    columns = columns.clamp_(max=vocab - 1)
    weights = probs.gather(1, columns).double().masked_fill_(~inside, 0.0)
    cdf = weights.cumsum(dim=-1) + before  # [n, B]
    # Rounding between the two levels can leave the target past the block's last sum:
    # take the block's last token with p > 0 then.
    last = torch.where(weights > 0, torch.arange(_CDF_BLOCK, device=probs.device), -1).amax(dim=-1)
    offset = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    offset = torch.minimum(offset, last).clamp_(min=0)
    return columns.gather(1, offset[:, None])[:, 0]


def _logprobs_of(raw: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Chosen token's logprob and rank (1 = most likely) and the top k, per row."""
    # raw: [n, vocab] log_softmax, token_ids: [n]
    chosen = raw.gather(1, token_ids[:, None])  # [n, 1]
    ranks = (raw > chosen).sum(dim=-1) + 1
    if k == 0:
        return LogprobsTensors(token_ids[:, None].clone(), chosen, ranks)
    top_values, top_ids = raw.topk(k, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([token_ids[:, None], top_ids], dim=1),
        logprobs=torch.cat([chosen, top_values], dim=1),
        ranks=ranks,
    )


def _noise_key(seed: int, position: int) -> int:
    """Generator seed for a seeded row's noise at an output position (splitmix64 mix, so
    nearby (seed, position) pairs such as the n children's seed + i do not collide)."""
    x = (seed * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & ((1 << 63) - 1)


def _widen(tensor: torch.Tensor, width: int, fill: float | bool) -> torch.Tensor:
    wider = torch.full((tensor.shape[0], width), fill, dtype=tensor.dtype, device=tensor.device)
    wider[:, : tensor.shape[1]] = tensor
    return wider
