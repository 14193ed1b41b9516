"""Cost of structured outputs per engine step, on the default model.

For each batch size B: B chat requests constrained by one JSON schema (and, as the
baseline, the same requests unconstrained, ignore_eos), greedy, --output-len tokens.
Per pure decode step with all B rows running, it times the constraint work (the logits
processors' apply: matcher catch-up, one batch bitmask fill, one bitmask apply; plus the
post-sample record: finished-row checks) against the whole step. Also reports grammar
compile time: tokenizer import (once per engine), cold compile, cached compile.
Writes JSON (default benchmarks/results/structured_outputs.json).

    python benchmarks/structured_outputs.py --batch-sizes 1 8 32 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

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


class Timed:
    """Wraps one pipeline method, summing its time within the current step."""

    def __init__(self, pipeline, name: str) -> None:
        self.inner = getattr(pipeline, name)
        self.seconds = 0.0
        setattr(pipeline, name, self)

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


def run_batch(engine, tokenizer, batch: int, output_len: int, constrained: bool) -> dict:
    pipeline = engine.runner.processors
    apply, record = Timed(pipeline, "apply"), Timed(pipeline, "record")
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
    steps: list[tuple[float, float]] = []
    while engine.has_unfinished_requests():
        apply.seconds = record.seconds = 0.0
        t = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t
        stats = engine.stats()
        full_decode = (
            stats.num_scheduled_tokens == batch == len(outputs)
            and all(len(o.new_token_ids) == 1 for o in outputs)
        )
        if full_decode:
            steps.append((dt, apply.seconds + record.seconds))
    pipeline.apply, pipeline.record = apply.inner, record.inner
    step_ms = [1000 * s for s, _ in steps]
    constraint_ms = [1000 * c for _, c in steps]
    return {
        "batch": batch,
        "constrained": constrained,
        "full_decode_steps": len(steps),
        "step_ms_median": statistics.median(step_ms) if steps else None,
        "constraint_ms_median": statistics.median(constraint_ms) if steps else None,
        "constraint_fraction_of_step": (
            statistics.median(c / s for s, c in steps) if steps else None
        ),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--out", default="benchmarks/results/structured_outputs.json")
    args = parser.parse_args()
    engine, tokenizer = EngineArgs(model=args.model, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
                                   kv_cache_memory_bytes=1 << 30).create_engine()
    result: dict = {"compile": compile_times(engine), "runs": []}
    print(json.dumps(result["compile"]))
    for batch in args.batch_sizes:
        for constrained in (False, True):
            row = run_batch(engine, tokenizer, batch, args.output_len, constrained)
            result["runs"].append(row)
            print(json.dumps(row))
    by = {(r["batch"], r["constrained"]): r for r in result["runs"]}
    b0 = min(args.batch_sizes)
    for batch in args.batch_sizes:
        c, u = by[(batch, True)], by[(batch, False)]
        if c["constraint_ms_median"] is not None and by[(b0, True)]["constraint_ms_median"]:
            print(f"B={batch}: constraint {c['constraint_ms_median']:.3f} ms/step "
                  f"({c['constraint_ms_median'] / by[(b0, True)]['constraint_ms_median']:.2f}x B={b0}), "
                  f"{100 * c['constraint_fraction_of_step']:.1f}% of the step; "
                  f"step {c['step_ms_median']:.1f} ms vs {u['step_ms_median']:.1f} ms unconstrained")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
