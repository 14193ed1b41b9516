"""Speculative decoding served: TPOT with and without it, at concurrency 1 and 32.

For each configuration this script starts `tokenmill serve` (the default model, bf16) on a
free port, runs three workloads with the project's load generator (`tokenmill.bench`),
reads the server's speculative-decoding counters from /metrics, and stops it:

1. `copy`, concurrency 1: chat requests asking the model to repeat a paragraph of
   `pydoc_data.topics` word for word (n-gram's home ground), greedy, up to 192 tokens.
2. `random`, concurrency 1: 128 random token ids as a completion prompt, 128 tokens,
   ignore_eos, greedy (little to copy: adaptivity must keep the cost down).
3. `random-c32`, concurrency 32: 64 such requests of 64 tokens (a batch where verifying
   drafts costs compute the batch no longer has spare).

Configurations: no speculation (baseline), n-gram (k=4, adaptive), n-gram with adaptivity
off (k=4 always: what the policy saves), and the self-draft (first 10 of 30 layers, k=3).
Reports median TPOT, output tokens/s and the acceptance rate per workload, and each
configuration's TPOT and throughput ratios against the baseline measured in the same run.

    python benchmarks/spec_decode.py [--configs baseline ngram ...] [--out FILE]
    python benchmarks/spec_decode.py --crossover    # where adaptivity turns speculation off
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gateway"))

from gateway_harness import Proc, free_port, metric_value  # noqa: E402

from tokenmill.bench.client import SamplingOptions  # noqa: E402
from tokenmill.bench.runner import LoadConfig, Target, run_benchmark  # noqa: E402
from tokenmill.bench.tokenizer import load_tokenizer  # noqa: E402
from tokenmill.bench.workloads import BenchRequest, LengthRange, random_requests  # noqa: E402

MODEL = "smollm2-135m-instruct"
CONFIGS: dict[str, dict[str, Any] | None] = {
    "baseline": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "ngram-fixed": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 5, "adaptive": False},
    "self-draft": {"method": "draft", "model": "self", "num_layers": 10, "num_speculative_tokens": 3},
}


def paragraphs(num: int, min_words: int = 60, max_words: int = 110) -> list[str]:
    """Prose paragraphs of Python's own documentation (ships with Python)."""
    from pydoc_data.topics import topics

    found: list[str] = []
    for key in sorted(topics):
        for block in topics[key].split("\n\n"):
            words = block.split()
            if min_words <= len(words) <= max_words and not block.startswith(" ") and "*" not in block:
                found.append(" ".join(words))
                if len(found) == num:
                    return found
    return found


def copy_requests(num: int) -> list[BenchRequest]:
    requests = []
    for text in paragraphs(num):
        content = f"Repeat the following text exactly, word for word:\n\n{text}"
        requests.append(BenchRequest(None, [{"role": "user", "content": content}], 192, None))
    return requests


def workloads(tokenizer: Any) -> list[tuple[str, str, list[BenchRequest], LoadConfig, SamplingOptions]]:
    random_c1 = random_requests(8, LengthRange(128, 128), LengthRange(128, 128), 1, tokenizer)
    random_c32 = random_requests(66, LengthRange(128, 128), LengthRange(64, 64), 2, tokenizer)
    # Token-id prompts on the completions endpoint: the random text stays what it is.
    random_c1 = [BenchRequest(r.prompt, None, r.output_len, r.prompt_len) for r in random_c1]
    random_c32 = [BenchRequest(r.prompt, None, r.output_len, r.prompt_len) for r in random_c32]
    greedy, fixed_len = SamplingOptions(temperature=0.0), SamplingOptions(temperature=0.0, ignore_eos=True)
    return [
        ("copy", "chat", copy_requests(9), LoadConfig(concurrency=1, num_warmups=1), greedy),
        ("random", "completions", random_c1, LoadConfig(concurrency=1, num_warmups=1), fixed_len),
        ("random-c32", "completions", random_c32, LoadConfig(concurrency=32, num_warmups=2), fixed_len),
    ]


def spec_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return (
        metric_value(text, "tokenmill:spec_decode_num_draft_tokens_total"),
        metric_value(text, "tokenmill:spec_decode_num_accepted_tokens_total"),
    )


def run_config(name: str, spec: dict[str, Any] | None, tmp: Path, tokenizer: Any) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", MODEL, "--port", str(port),
           "--max-num-seqs", "32", "--max-model-len", "2048"]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    proc = Proc(cmd, tmp / f"{name}.log", url + "/ready")
    results: dict[str, Any] = {}
    try:
        for label, endpoint, requests, load, options in workloads(tokenizer):
            before = spec_counters(url)
            target = Target(base_url=url, model=MODEL, endpoint=endpoint, options=options)
            report = asyncio.run(run_benchmark(target, requests, load, None, tokenizer, show_progress=False))
            drafts, accepted = (a - b for a, b in zip(spec_counters(url), before, strict=True))
            results[label] = {
                "tpot_median_ms": report["tpot_ms"]["median"],
                "itl_median_ms": report["itl_ms"]["median"],
                "ttft_median_ms": report["ttft_ms"]["median"],
                "output_throughput": report["output_throughput"],
                "output_tokens": report["total_output_tokens"],
                "failed": report["failed"],
                "draft_tokens": drafts,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafts if drafts else None,
            }
            print(f"{name:12s} {label:11s} TPOT {report['tpot_ms']['median']:7.2f} ms  "
                  f"{report['output_throughput']:7.1f} tok/s  drafts {drafts:6.0f} accepted {accepted:6.0f}",
                  flush=True)
    finally:
        proc.stop()
    return results


def crossover() -> dict[str, Any]:
    """Where the policy switches speculation off on this machine: the engine's measured
    forward costs, and for each per-draft acceptance the largest batch of decodes that
    still verifies drafts (n-gram, k = 4, every request with 4 drafts in hand)."""
    from tokenmill import LLM
    from tokenmill.engine.spec_decode.policy import SpecDecodePolicy

    llm = LLM(MODEL, speculative=CONFIGS["ngram"], max_num_seqs=64, max_model_len=2048)
    policy = llm.core.scheduler.spec_policy
    assert policy is not None and policy.cost is not None
    cost = policy.cost
    table = {str(t): round(1e3 * s, 2) for t, s in zip(cost.tokens, cost.seconds, strict=True)}
    result: dict[str, Any] = {"forward_ms_by_tokens": table, "largest_batch_that_speculates": {}}
    for alpha in (0.3, 0.5, 0.7, 0.9):
        largest = 0
        for batch in range(1, 65):
            fixed = SpecDecodePolicy(4, cost, prior_alpha=alpha)  # fresh requests: the prior
            if fixed.plan({f"r{i}": 4 for i in range(batch)}, batch, batch):
                largest = batch
        result["largest_batch_that_speculates"][str(alpha)] = largest
    print("forward ms by tokens:", table)
    print("largest batch that speculates, by acceptance:", result["largest_batch_that_speculates"])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode.json"))
    parser.add_argument("--crossover", action="store_true", help="only measure the policy's crossover")
    args = parser.parse_args()
    if args.crossover:
        out = Path(args.out).with_name("spec_decode_crossover.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(crossover(), indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    tokenizer = load_tokenizer(MODEL)
    # Build the C++ kernels once here, so no server's start-up waits on a compile.
    from tokenmill.engine.runner.attention import load_cpu_kernel

    load_cpu_kernel()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.configs:
            runs[name] = run_config(name, CONFIGS[name], Path(tmp), tokenizer)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    ratios: dict[str, Any] = {}
    if "baseline" in runs:
        base = runs["baseline"]
        for name, result in runs.items():
            if name == "baseline":
                continue
            ratios[name] = {
                label: {
                    "tpot_speedup": base[label]["tpot_median_ms"] / r["tpot_median_ms"],
                    "throughput_ratio": r["output_throughput"] / base[label]["output_throughput"],
                }
                for label, r in result.items()
            }
        for name, by_label in ratios.items():
            print(name, {k: {m: round(v, 3) for m, v in d.items()} for k, d in by_label.items()})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "started": started, "machine": platform.processor() or platform.machine(),
        "loadavg_before": load_before, "loadavg_after": load_after,
        "configs": {k: CONFIGS[k] for k in args.configs}, "results": runs, "ratios": ratios,
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
