"""Per-layer paged attention time: C++ kernel vs torch fallback vs contiguous SDPA.

SmolLM2-135M attention shape (9 query heads, 3 KV heads, head_dim 64, block_size 16).

  decode   batch 1/8/32/64, context 384 (383 cached + 1 new token per request)
  prefill  one fresh prompt of 256/1024/2048 tokens

Per case and dtype:
  kernel      write_kv + kernel attention over shuffled, scattered blocks
  fallback    write_kv + the torch backend (gather blocks, then SDPA)
  contiguous  SDPA on K/V already laid out contiguously: no paging, no gather, no cache
              write, the lower bound a paged cache is measured against

--kv-cache-dtype fp8|int8 stores the paged caches as one-byte codes with per-block scales
(the kernel and the fallback dequantize as they read, write_kv quantizes); the contiguous
baseline stays in the query dtype.

Caches of several layers are rotated so each timed call reads K/V from memory as a real
step does, not from a cache level warmed by the previous call. The machine is shared: only
ratios within one run mean much.

    PYTHONPATH=src python benchmarks/attention_kernel.py [--quick] [--kv-cache-dtype fp8]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.engine.runner.attention import AttentionMetadata, PagedAttention
from tokenmill.engine.runner.kv_cache_tensors import resolve_kv_cache_dtype
from tokenmill.engine.runner.kv_quantization import is_quantized, write_quantized

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
NUM_LAYER_COPIES = 6
RESULTS = Path(__file__).parent / "results" / "attention_kernel.json"


def time_ms(fn: Callable[[int], object], reps: int) -> float:
    """Fastest wall time of fn(i) in ms over reps calls, after two warm-up calls.

    The minimum, not the median: on a shared 2-core machine most of the spread is other
    processes taking the cores, which says nothing about the code being timed.
    """
    fn(0)
    fn(1)
    samples = []
    for i in range(reps):
        start = time.perf_counter()
        fn(i)
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples)


def build_case(
    requests: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0, cache_dtype: torch.dtype | None = None
):
    """Caches for NUM_LAYER_COPIES layers (k, v, scales or None), shuffled block ids, and one
    step's inputs."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq // BLOCK_SIZE) for seq, _ in requests]
    num_blocks = sum(blocks_per_req)
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = torch.zeros(len(requests), max(blocks_per_req), dtype=torch.int32)
    slots, qsl, used = [], [0], 0
    for r, ((seq, n), nb) in enumerate(zip(requests, blocks_per_req, strict=True)):
        table[r, :nb] = ids[used : used + nb]
        used += nb
        slots += [
            int(table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
            for p in range(seq - n, seq)
        ]
        qsl.append(qsl[-1] + n)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    caches = [
        _cache(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), cache_dtype or dtype)
        for _ in range(NUM_LAYER_COPIES)
    ]
    num_tokens = qsl[-1]
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    md = AttentionMetadata.build(
        block_table=table,
        seq_lens=torch.tensor([s for s, _ in requests], dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(n for _, n in requests),
        block_size=BLOCK_SIZE,
    )
    return q, k, v, caches, md


def _cache(k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype):
    if not is_quantized(cache_dtype):
        return k.to(cache_dtype), v.to(cache_dtype), None
    codes = torch.zeros(k.shape, dtype=cache_dtype), torch.zeros(v.shape, dtype=cache_dtype)
    scales = torch.zeros(k.shape[:2]), torch.zeros(k.shape[:2])
    blocks = torch.arange(k.shape[0]).repeat_interleave(BLOCK_SIZE)
    offsets = torch.arange(BLOCK_SIZE).repeat(k.shape[0])
    for x, c, s in zip((k, v), codes, scales, strict=True):
        write_quantized(x.transpose(1, 2).reshape(-1, k.shape[1], k.shape[3]), c, s, blocks, offsets)
    return codes[0], codes[1], scales


def paged_ms(
    attn: PagedAttention,
    requests: list[tuple[int, int]],
    dtype: torch.dtype,
    reps: int,
    cache_dtype: torch.dtype | None = None,
) -> float:
    q, k, v, caches, md = build_case(requests, dtype, cache_dtype=cache_dtype)

    def step(i: int) -> None:
        k_cache, v_cache, scales = caches[i % len(caches)]
        attn.write_kv(k, v, k_cache, v_cache, md, scales)
        attn.forward(q, k_cache, v_cache, md, scales)

    return time_ms(step, reps)


def contiguous_decode_ms(batch: int, context: int, dtype: torch.dtype, reps: int) -> float:
    q = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM).to(dtype)
    kv = [
        (
            torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM).to(dtype),
            torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM).to(dtype),
        )
        for _ in range(NUM_LAYER_COPIES)
    ]

    def step(i: int) -> None:
        k, v = kv[i % len(kv)]
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    return time_ms(step, reps)


def contiguous_prefill_ms(n: int, dtype: torch.dtype, reps: int) -> float:
    # [1, heads, n, hd]: a 3-D input would take SDPA's much slower math path.
    q = torch.randn(1, NUM_HEADS, n, HEAD_DIM).to(dtype)
    kv = [
        (
            torch.randn(1, NUM_KV_HEADS, n, HEAD_DIM).to(dtype),
            torch.randn(1, NUM_KV_HEADS, n, HEAD_DIM).to(dtype),
        )
        for _ in range(NUM_LAYER_COPIES)
    ]

    def step(i: int) -> None:
        k, v = kv[i % len(kv)]
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return time_ms(step, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    kernel = PagedAttention("cpu", backend="kernel")
    fallback = PagedAttention("cpu", backend="torch")
    rows = []
    torch.set_grad_enabled(False)
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
        for batch in (1, 8, 32, 64):
            reps = 20 if args.quick else 100
            requests = [(384, 1)] * batch
            row = {
                "case": f"decode_b{batch}_ctx384",
                "dtype": name,
                "kv_cache_dtype": str(cache_dtype).removeprefix("torch."),
                "kernel_ms": paged_ms(kernel, requests, dtype, reps, cache_dtype),
                "fallback_ms": paged_ms(fallback, requests, dtype, reps, cache_dtype),
                "contiguous_sdpa_ms": contiguous_decode_ms(batch, 384, dtype, reps),
            }
            rows.append(row)
            print(_fmt(row), flush=True)
        for n in (256, 1024, 2048):
            reps = 3 if args.quick else (10 if n > 256 else 30)
            requests = [(n, n)]
            row = {
                "case": f"prefill_{n}",
                "dtype": name,
                "kv_cache_dtype": str(cache_dtype).removeprefix("torch."),
                "kernel_ms": paged_ms(kernel, requests, dtype, reps, cache_dtype),
                "fallback_ms": paged_ms(fallback, requests, dtype, reps, cache_dtype),
                "contiguous_sdpa_ms": contiguous_prefill_ms(n, dtype, reps),
            }
            rows.append(row)
            print(_fmt(row), flush=True)
    for row in rows:
        row["kernel_vs_contiguous"] = round(row["kernel_ms"] / row["contiguous_sdpa_ms"], 3)
        row["fallback_vs_kernel"] = round(row["fallback_ms"] / row["kernel_ms"], 3)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "shape": {
                    "num_heads": NUM_HEADS,
                    "num_kv_heads": NUM_KV_HEADS,
                    "head_dim": HEAD_DIM,
                    "block_size": BLOCK_SIZE,
                },
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "machine": platform.processor() or platform.machine(),
                "unit": "ms per layer (fastest of the repetitions)",
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


def _fmt(row: dict) -> str:
    return (
        f"{row['case']:>20} {row['dtype']:>8} kv {row['kv_cache_dtype']:>13}  kernel {row['kernel_ms']:8.3f}  "
        f"fallback {row['fallback_ms']:8.3f}  contiguous {row['contiguous_sdpa_ms']:8.3f}"
    )


if __name__ == "__main__":
    main()
