"""Offline throughput and per-step latency of the engine on the default model.

For each batch size B: B requests of --input-len random prompt tokens and --output-len
output tokens (ignore_eos), submitted at once. Reports
  - output tok/s over the whole run (prefill included) and over the decode phase,
  - per-step latency of pure decode steps (median, p90) and of prefill steps,
  - prefill throughput (prompt tokens / s of prefill-only steps),
  - the machine's measured bf16 (and fp32) matmul peak, and the fraction of it the decode
    steps reach (2 * matmul params * B FLOPs per step).
Writes JSON (default benchmarks/results/offline_throughput.json).

    python benchmarks/offline_throughput.py --batch-sizes 1 8 32 64
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from tokenmill.engine.engine_args import DEFAULT_MODEL, EngineArgs
from tokenmill.engine.request import Request, SamplingParams


def matmul_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """Best FLOP/s of an [n, n] x [n, n] matmul."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def matmul_params(engine) -> int:
    """Weights every token multiplies: the projections of all layers plus the LM head."""
    c = engine.config.model
    attn = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    attn += c.num_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + mlp) + c.vocab_size * c.hidden_size


def run_batch(engine, batch: int, input_len: int, output_len: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + batch)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        prompt = torch.randint(100, vocab, (input_len,), generator=gen).tolist()
        engine.add_request(Request(f"b{batch}-{i}", prompt, params))
    decode_steps: list[float] = []
    prefill_steps: list[tuple[float, int]] = []
    generated = 0
    start = time.perf_counter()
    first_decode = None
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t
        stats = engine.stats()
        generated += sum(len(o.new_token_ids) for o in outputs)
        if stats.num_scheduled_tokens == len(outputs) and all(len(o.new_token_ids) == 1 for o in outputs):
            decode_steps.append(dt)
            if first_decode is None:
                first_decode = t
        else:
            prefill_steps.append((dt, stats.num_scheduled_tokens))
    total = time.perf_counter() - start
    decode_time = sum(decode_steps)
    decode_tokens = batch * len(decode_steps) if decode_steps else 0
    prefill_time = sum(d for d, _ in prefill_steps)
    prefill_tokens = sum(n for _, n in prefill_steps)
    decode_steps_sorted = sorted(decode_steps)
    return {
        "batch": batch,
        "output_tokens": generated,
        "total_s": total,
        "output_tok_per_s": generated / total,
        "decode_tok_per_s": decode_tokens / decode_time if decode_time else None,
        "decode_step_ms_median": 1000 * statistics.median(decode_steps) if decode_steps else None,
        "decode_step_ms_p90": 1000 * decode_steps_sorted[int(0.9 * (len(decode_steps) - 1))] if decode_steps else None,
        "num_decode_steps": len(decode_steps),
        "prefill_tok_per_s": prefill_tokens / prefill_time if prefill_time else None,
        "num_prefill_steps": len(prefill_steps),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/offline_throughput.json")
    args = parser.parse_args()

    peaks = {"bf16_flops": matmul_peak(torch.bfloat16), "fp32_flops": matmul_peak(torch.float32)}
    engine, _ = EngineArgs(
        model=args.model,
        dtype=args.dtype,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=False,  # random prompts; measure compute, not cache hits
    ).create_engine()
    dtype = engine.runner.dtype
    flops_per_token = 2 * matmul_params(engine)
    peak = peaks["bf16_flops"] if dtype == torch.bfloat16 else peaks["fp32_flops"]
    results = []
    run_batch(engine, 2, 32, 4, args.seed)  # warm-up
    for batch in args.batch_sizes:
        r = run_batch(engine, batch, args.input_len, args.output_len, args.seed)
        if r["decode_tok_per_s"]:
            r["decode_fraction_of_peak"] = r["decode_tok_per_s"] * flops_per_token / peak
        results.append(r)
        print(json.dumps(r))
    report = {
        "model": args.model,
        "dtype": str(dtype),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "matmul_peak": peaks,
        "matmul_params": flops_per_token // 2,
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"peak bf16 {peaks['bf16_flops'] / 1e12:.2f} TFLOP/s, fp32 {peaks['fp32_flops'] / 1e12:.2f} TFLOP/s -> {out}")


if __name__ == "__main__":
    main()
