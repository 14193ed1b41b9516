"""Cost of structured outputs per engine step, on the default model.

For each batch size B: B chat requests constrained by one JSON schema (and, as the
baseline, the same requests unconstrained, ignore_eos), greedy, --output-len tokens.
Per pure decode step with all B rows running, it times the constraint work on the step's
critical path against the whole step: the pipeline's grammar_mask (or apply) -- matcher
catch-up, joining the batch bitmask fill that ran on the worker thread during the forward
(or filling it, when the rows changed), the mask itself -- and the post-sample record
(finished-row checks). The mask rides in the logits' bf16 -> fp32 conversion: it counts
as that fused conversion's time minus a plain conversion of the same logits, timed beside
it in the same step (both are reported). The worker thread's fill is reported too: it
overlaps the forward, and the constrained vs unconstrained step times show what it costs
the step on this CPU. Also reports grammar compile time: tokenizer import (once per
engine), cold compile, cached compile.
Batch sizes run in --rounds interleaved rounds (unconstrained then constrained, each
batch size in turn); each figure is the median of its rounds' medians. Writes JSON
(default benchmarks/results/structured_outputs.json).

--serving instead starts one `tokenmill serve` and measures, with the project's load
generator at concurrency 32, chat requests whose reply is constrained by a JSON schema
long enough to run to max_tokens against the same requests unconstrained (ignore_eos),
so both sides generate the same number of tokens; rounds alternate the two.

    python benchmarks/structured_outputs.py --batch-sizes 1 8 32 64
    python benchmarks/structured_outputs.py --serving
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tokenmill.engine.runner.model_runner as model_runner
from tokenmill.engine.engine_args import DEFAULT_MODEL, EngineArgs
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.structured_output.spec import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "year": {"type": "integer"}},
                "required": ["name", "year"],
            },
            "minItems": 1,
        },
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "landmarks", "capital"],
}


# The serving comparison's schema: a list of at least 12 cities runs past 128 tokens.
LONG_SCHEMA = {
    "type": "object",
    "properties": {"cities": {"type": "array", "items": SCHEMA, "minItems": 12}},
    "required": ["cities"],
}


class Timed:
    """Wraps one attribute (a pipeline method, a module's function), summing its time
    within the current step; restore() puts the original back."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name
        self.inner = getattr(owner, name)
        self.seconds = 0.0
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t

    def restore(self) -> None:
        setattr(self.owner, self.name, self.inner)


class TimedConversion(Timed):
    """model_runner.masked_float, timed beside a plain float conversion of the same logits
    (what an unconstrained step pays in compute_logits), so the mask's share is the
    difference."""

    def __init__(self) -> None:
        super().__init__(model_runner, "masked_float")
        self.plain_seconds = 0.0

    def __call__(self, logits, *args, **kwargs):
        t = time.perf_counter()
        logits.float()
        self.plain_seconds += time.perf_counter() - t
        return super().__call__(logits, *args, **kwargs)


def run_batch(engine, tokenizer, batch: int, output_len: int, constrained: bool) -> dict:
    pipeline = engine.runner.processors
    timers = [Timed(pipeline, "apply"), Timed(pipeline, "grammar_mask"), Timed(pipeline, "record")]
    conversion = TimedConversion()
    fill = Timed(pipeline._structured, "_fill")  # the worker thread's fill (and any refill)
    spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=not constrained, structured_outputs=spec
    )
    cities = ["Paris", "Rome", "Kyoto", "Lima", "Oslo", "Cairo", "Quito", "Hanoi"]
    for i in range(batch):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Describe {cities[i % len(cities)]} (#{i}) as JSON."}]
        )
        engine.add_request(Request(f"b{batch}-{constrained}-{i}", tokenizer.encode(text), params,
                                   eos_token_ids=tokenizer.eos_token_ids))
    steps: list[dict[str, float]] = []
    while engine.has_unfinished_requests():
        for timer in (*timers, conversion, fill):
            timer.seconds = 0.0
        conversion.plain_seconds = 0.0
        t = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t
        stats = engine.stats()
        full_decode = (
            stats.num_scheduled_tokens == batch == len(outputs)
            and all(len(o.new_token_ids) == 1 for o in outputs)
        )
        if full_decode:
            mask_share = max(0.0, conversion.seconds - conversion.plain_seconds)
            pipeline_s = sum(timer.seconds for timer in timers)
            # The side conversion is the benchmark's own work: not part of the step.
            step_s = dt - conversion.plain_seconds
            steps.append({"step": step_s, "constraint": pipeline_s + mask_share, "pipeline": pipeline_s,
                          "fused_conversion": conversion.seconds, "plain_conversion": conversion.plain_seconds,
                          "worker_fill": fill.seconds})
    for timer in (*timers, conversion, fill):
        timer.restore()

    def median_ms(key: str) -> float | None:
        return 1000 * statistics.median(s[key] for s in steps) if steps else None

    return {
        "batch": batch,
        "constrained": constrained,
        "full_decode_steps": len(steps),
        "step_ms_median": median_ms("step"),
        "constraint_ms_median": median_ms("constraint"),
        "constraint_fraction_of_step": (
            statistics.median(s["constraint"] / s["step"] for s in steps) if steps else None
        ),
        "pipeline_ms_median": median_ms("pipeline"),
        "fused_conversion_ms_median": median_ms("fused_conversion"),
        "plain_conversion_ms_median": median_ms("plain_conversion"),
        "worker_fill_ms_median": median_ms("worker_fill"),
    }


def compile_times(engine) -> dict:
    compiler = engine.grammar_compiler
    backend = compiler.backend
    t = time.perf_counter()
    backend.tokenizer  # noqa: B018  (built once per engine)
    tokenizer_s = time.perf_counter() - t
    variant = {**SCHEMA, "description": f"cold {time.time()}"}
    t = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=variant))
    cold_s = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile(StructuredOutputsParams(json=variant))
    cached_s = time.perf_counter() - t
    return {"tokenizer_import_ms": 1000 * tokenizer_s, "cold_compile_ms": 1000 * cold_s,
            "cached_compile_ms": 1000 * cached_s}


def serving(model: str, rounds: int, num_prompts: int, concurrency: int, output_len: int) -> dict[str, Any]:
    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "tests" / "gateway"))
    from gateway_harness import Proc, free_port

    from tokenmill.bench.client import SamplingOptions
    from tokenmill.bench.runner import LoadConfig, Target, run_benchmark
    from tokenmill.bench.tokenizer import load_tokenizer
    from tokenmill.bench.workloads import BenchRequest

    tokenizer = load_tokenizer(model)
    regions = ["France", "Italy", "Japan", "Peru", "Norway", "Egypt", "Ecuador", "Vietnam"]
    requests = [
        BenchRequest(None, [{"role": "user", "content": f"List the cities of {regions[i % 8]} (#{i}) as JSON."}],
                     output_len, None)
        for i in range(num_prompts)
    ]
    response_format = {"type": "json_schema", "json_schema": {"name": "cities", "schema": LONG_SCHEMA}}
    options = {
        "unconstrained": SamplingOptions(temperature=0.0, ignore_eos=True),
        "constrained": SamplingOptions(temperature=0.0, extra_body=(("response_format", response_format),)),
    }
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", model, "--port", str(port),
           "--max-num-seqs", str(concurrency)]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in options}
    with tempfile.TemporaryDirectory() as tmp:
        proc = Proc(cmd, Path(tmp) / "serve.log", url + "/ready")
        try:
            for _ in range(rounds):
                for name, opts in options.items():
                    target = Target(base_url=url, model=model, endpoint="chat", options=opts)
                    load = LoadConfig(concurrency=concurrency, num_warmups=2)
                    report = asyncio.run(run_benchmark(target, requests, load, None, tokenizer, show_progress=False))
                    row = {"output_throughput": report["output_throughput"], "tpot_median_ms": report["tpot_ms"]["median"],
                           "ttft_median_ms": report["ttft_ms"]["median"], "output_tokens": report["total_output_tokens"],
                           "failed": report["failed"]}
                    runs[name].append(row)
                    print(name, json.dumps(row), flush=True)
        finally:
            proc.stop()
    summary = {name: {key: statistics.median(r[key] for r in rows) for key in rows[0]} for name, rows in runs.items()}
    c, u = summary["constrained"], summary["unconstrained"]
    print(f"c={concurrency}: constrained {c['output_throughput']:.1f} tok/s (TPOT {c['tpot_median_ms']:.1f} ms) vs "
          f"unconstrained {u['output_throughput']:.1f} tok/s (TPOT {u['tpot_median_ms']:.1f} ms): "
          f"{c['output_throughput'] / u['output_throughput']:.3f}x throughput")
    return {"concurrency": concurrency, "rounds": runs, "median": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serving", action="store_true", help="constrained vs unconstrained serving at c=32")
    parser.add_argument("--out", default=None, help="default benchmarks/results/structured_outputs[_serving].json")
    args = parser.parse_args()
    if args.serving:
        out = Path(args.out or "benchmarks/results/structured_outputs_serving.json")
        result = serving(args.model, max(args.rounds, 1), num_prompts=66, concurrency=32, output_len=128)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        return
    engine, tokenizer = EngineArgs(model=args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
                                   kv_cache_memory_bytes=1 << 30).create_engine()
    result: dict = {"compile": compile_times(engine), "rounds": []}
    print(json.dumps(result["compile"]))
    for _ in range(args.rounds):
        for batch in args.batch_sizes:
            for constrained in (False, True):
                row = run_batch(engine, tokenizer, batch, args.output_len, constrained)
                result["rounds"].append(row)
                print(json.dumps(row))
    result["runs"] = [median_run([r for r in result["rounds"] if (r["batch"], r["constrained"]) == key])
                      for key in dict.fromkeys((r["batch"], r["constrained"]) for r in result["rounds"])]
    by = {(r["batch"], r["constrained"]): r for r in result["runs"]}
    b0 = min(args.batch_sizes)
    for batch in args.batch_sizes:
        c, u = by[(batch, True)], by[(batch, False)]
        if c["constraint_ms_median"] is not None and by[(b0, True)]["constraint_ms_median"]:
            print(f"B={batch}: constraint {c['constraint_ms_median']:.3f} ms/step "
                  f"({c['constraint_ms_median'] / by[(b0, True)]['constraint_ms_median']:.2f}x B={b0}), "
                  f"{100 * c['constraint_fraction_of_step']:.1f}% of the step; "
                  f"step {c['step_ms_median']:.1f} ms vs {u['step_ms_median']:.1f} ms unconstrained")
    out = Path(args.out or "benchmarks/results/structured_outputs.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


def median_run(rows: list[dict]) -> dict:
    """One batch size's rounds folded into one row: the median of each figure."""
    merged = dict(rows[0])
    for key in rows[0]:
        if key.endswith("_median") or key == "constraint_fraction_of_step":
            values = [r[key] for r in rows if r[key] is not None]
            merged[key] = statistics.median(values) if values else None
    merged["rounds"] = len(rows)
    return merged


if __name__ == "__main__":
    main()
