"""HF transformers `generate` as the static-batching baseline, measured like a server.

The closed-loop workload at concurrency C is served the way a static batcher serves it:
requests are taken C at a time, each batch is left-padded into one `generate` call that
runs until every sequence has its `max_tokens` (`min_new_tokens` = `max_new_tokens`, the
equivalent of ignore_eos), and the next batch starts only when the whole batch is done.
A request of a batch is "sent" when its batch starts; a stopping-criteria hook stamps the
end of every decoding step, so TTFT is the first step's end (prefill included), ITL the
gaps between steps, and E2E the batch's end. The RequestResults go through the same
`summarize` as the HTTP runs, so every number means the same thing.
"""

from __future__ import annotations

import itertools
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch
import transformers

from tokenmill.bench.client import RequestResult
from tokenmill.bench.metrics import summarize
from tokenmill.bench.workloads import BenchRequest


class _StepClock(transformers.StoppingCriteria):
    """Records the time each generated token lands; never stops generation itself."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class StaticBatcher:
    def __init__(self, hf_dir: str, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
        self.model.eval()
        self.pad_id = self.model.config.eos_token_id
        if isinstance(self.pad_id, list):
            self.pad_id = self.pad_id[0]

    def run_batch(self, batch: Sequence[BenchRequest]) -> list[RequestResult]:
        max_new = max(r.output_len for r in batch)
        prompts = [list(r.prompt) for r in batch if isinstance(r.prompt, list)]
        if len(prompts) != len(batch):
            raise ValueError("the static baseline takes token-id prompts (the random workload)")
        width = max(len(p) for p in prompts)
        # left padding: every sequence's last prompt token sits in the same column
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        clock = _StepClock()
        start = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                do_sample=False, stopping_criteria=transformers.StoppingCriteriaList([clock]),
                pad_token_id=self.pad_id,
            )
        end = time.perf_counter()
        steps = clock.times
        num_new = out.shape[1] - width
        return [
            RequestResult(
                ok=True, start_s=start, ttft_s=steps[0] - start, e2e_s=end - start,
                itl_s=[b - a for a, b in itertools.pairwise(steps)],
                output_tokens=num_new, prompt_tokens=len(p),
            )
            for p in prompts
        ]

    def run(self, requests: Sequence[BenchRequest], batch_size: int, num_warmups: int) -> dict[str, Any]:
        """Warm-ups in one batch, then the measured requests in batches of `batch_size`."""
        if num_warmups:
            self.run_batch(requests[:num_warmups])
        measured = requests[num_warmups:]
        results: list[RequestResult] = []
        start = time.perf_counter()
        for i in range(0, len(measured), batch_size):
            results += self.run_batch(measured[i : i + batch_size])
        duration = time.perf_counter() - start
        return {
            "config": {
                "base_url": "in-process", "model": "hf-transformers", "endpoint": "generate",
                "concurrency": batch_size, "request_rate": None, "burstiness": 1.0, "num_prompts": len(measured),
                "num_warmups": num_warmups,
            },
            "client": {"python": platform.python_version(), "transformers": transformers.__version__},
            **summarize(results, duration),
        }
