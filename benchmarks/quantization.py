"""Weight and KV-cache quantization on the default model: memory, quality, speed, vs bf16.

For each weight scheme (bf16, int8, int4 from the GGUF's own Q4 codes, fp8), and each KV
scheme (--kv-schemes: fp8 and int8 K/V blocks, with bf16 weights):
  - weight bytes (codes, scales, the bf16 embedding and LM head) and KV tokens per GiB,
  - perplexity on the first --eval-tokens tokens of the pydoc topics (quality.py): without
    a KV cache ("perplexity", what weight schemes change) and through the engine's paged
    cache with chunked prefill ("cached_perplexity", what KV schemes change; bf16 and the
    KV schemes only),
  - greedy agreement with bf16 on a fixed prompt set (--agree-tokens tokens each),
  - batch-1 decode step (median) and batch-32 decode throughput, as offline_throughput.py
    measures them (256-token random prompts, --output-len tokens). This machine's speed
    drifts by +-30% over minutes, so every engine stays loaded and the speed runs go in
    --speed-rounds rounds, each round running every scheme once in turn; the medians over
    rounds are reported, and every ratio compares runs of the same rounds.
Writes JSON (default benchmarks/results/quantization.json).

    python benchmarks/quantization.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offline_throughput import run_batch

from tokenmill.engine.engine_args import DEFAULT_MODEL, EngineArgs
from tokenmill.engine.quantization.apply import weight_bytes
from tokenmill.engine.quantization.quality import (
    cached_perplexity,
    evaluation_text,
    greedy_agreement,
    perplexity,
)
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.runner.kv_cache_tensors import bytes_per_block

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a Python function that reverses a string.",
    "What is 17 times 23?",
]


def greedy(engine, tokenizer, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, text in enumerate(PROMPTS):
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        engine.add_request(Request(f"g{i}", ids, params, eos_token_ids=tokenizer.eos_token_ids))
    out: dict[str, list[int]] = {f"g{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.req_id].extend(o.new_token_ids)
    return [out[f"g{i}"] for i in range(len(PROMPTS))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--schemes", nargs="+", default=["bf16", "int8", "int4", "fp8"])
    parser.add_argument("--kv-schemes", nargs="*", default=["fp8", "int8"])
    parser.add_argument("--eval-tokens", type=int, default=20_000)
    parser.add_argument("--agree-tokens", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--speed-rounds", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/quantization.json")
    args = parser.parse_args()
    rows = []
    engines = []
    reference: list[list[int]] | None = None
    runs = [(scheme, "auto") for scheme in args.schemes] + [("bf16", kv) for kv in args.kv_schemes]
    for scheme, kv_dtype in runs:
        quantization = None if scheme == "bf16" else scheme
        engine, tokenizer = EngineArgs(model=args.model, dtype="bfloat16", quantization=quantization,
                                       max_num_seqs=32, kv_cache_memory_bytes=1 << 28,
                                       enable_prefix_caching=False, kv_cache_dtype=kv_dtype).create_engine()
        model = engine.runner.model
        ids = tokenizer.encode(evaluation_text())[: args.eval_tokens]
        outputs = greedy(engine, tokenizer, args.agree_tokens)
        reference = reference or outputs
        c = engine.config
        per_block = bytes_per_block(c.model, c.cache.block_size, engine.runner.dtype, kv_dtype)
        row = {
            "scheme": scheme if kv_dtype == "auto" else f"kv-{kv_dtype}",
            "kv_cache_dtype": kv_dtype,
            "weight_bytes": weight_bytes(model),
            "kv_tokens_per_gib": (1 << 30) // per_block * c.cache.block_size,
            "perplexity": perplexity(model, ids) if kv_dtype == "auto" else None,
            "cached_perplexity": cached_perplexity(engine, ids) if scheme == "bf16" else None,
            "greedy_agreement": greedy_agreement(reference, outputs),
            "batch1_rounds": [], "batch32_rounds": [],
        }
        rows.append(row)
        engines.append(engine)
        print(json.dumps(row), flush=True)
    for r in range(args.speed_rounds):
        for row, engine in zip(rows, engines, strict=True):
            row["batch1_rounds"].append(run_batch(engine, 1, 256, args.output_len, r))
            row["batch32_rounds"].append(run_batch(engine, 32, 256, args.output_len, r))
            print(f"round {r} {row['scheme']}: b1 step {row['batch1_rounds'][-1]['decode_step_ms_median']:.1f} ms, "
                  f"b32 {row['batch32_rounds'][-1]['decode_tok_per_s']:.0f} tok/s", flush=True)
    for row in rows:
        row["batch1"] = {"decode_step_ms_median": statistics.median(
            b["decode_step_ms_median"] for b in row["batch1_rounds"])}
        row["batch32"] = {"decode_tok_per_s": statistics.median(
            b["decode_tok_per_s"] for b in row["batch32_rounds"])}
    base = rows[0]
    for row in rows[1:]:
        if row["kv_cache_dtype"] == "auto":
            quality = f"perplexity {row['perplexity'] / base['perplexity'] - 1:+.2%}"
        else:
            quality = (f"KV tokens/GiB {row['kv_tokens_per_gib'] / base['kv_tokens_per_gib']:.3f}x, cached "
                       f"perplexity {row['cached_perplexity'] / base['cached_perplexity'] - 1:+.2%}")
        print(f"{row['scheme']}: weights {row['weight_bytes'] / base['weight_bytes']:.2f}x, "
              f"{quality}, agreement {row['greedy_agreement']:.1%}, "
              f"b1 step {base['batch1']['decode_step_ms_median'] / row['batch1']['decode_step_ms_median']:.2f}x faster, "
              f"b32 {row['batch32']['decode_tok_per_s'] / base['batch32']['decode_tok_per_s']:.2f}x throughput")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
