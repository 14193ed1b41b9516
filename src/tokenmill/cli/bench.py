"""`tokenmill bench serve`: load-test any OpenAI-compatible server (see tokenmill.bench)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from tokenmill.cli.argtypes import non_negative_int, positive_int

API_KEY_ENV = "OPENAI_API_KEY"


def register(subparsers: Any) -> None:
    """Add the `bench` command group to the top-level parser's subparsers."""
    parser = subparsers.add_parser("bench", help="benchmark a serving endpoint")
    parser.set_defaults(handler=lambda args: _usage(parser))
    commands = parser.add_subparsers(title="bench commands", metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="streaming load test of an OpenAI-compatible server: TTFT, TPOT, ITL, E2E, throughput",
        description="Streaming load test of an OpenAI-compatible server. Exit status 1 if any "
        "measured request failed.",
    )
    add_serve_arguments(serve)
    serve.set_defaults(handler=serve_command)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, with or without /v1")
    target.add_argument("--model", required=True, help="model name the server expects")
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    target.add_argument("--api-key", default=None, help=f"bearer token (default: ${API_KEY_ENV})")
    target.add_argument("--request-timeout", type=_positive_float, default=1800.0, help="seconds per request")
    target.add_argument(
        "--ready-timeout", type=float, default=0.0,
        help="first wait up to this long for a 1-token probe to succeed (a server still loading)",
    )
    workload = parser.add_argument_group("workload")
    workload.add_argument("--dataset", choices=["random", "sharegpt", "multi-turn"], default="random")
    workload.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (--dataset sharegpt)")
    workload.add_argument("--input-len", default="256", help="random prompt tokens: N or LOW:HIGH (default 256)")
    workload.add_argument(
        "--output-len", default=None,
        help="max_tokens: N or LOW:HIGH (default 128; ShareGPT: the recorded reply's length)",
    )
    workload.add_argument("--num-system-prompts", type=positive_int, default=4, help="multi-turn (default 4)")
    workload.add_argument("--system-prompt-len", type=positive_int, default=512, help="multi-turn, words (default 512)")
    workload.add_argument("--num-turns", type=positive_int, default=4, help="multi-turn (default 4)")
    workload.add_argument("--turn-len", type=positive_int, default=32, help="multi-turn words per message (default 32)")
    workload.add_argument(
        "--tokenizer", default=None,
        help="tokenizer.json, HF dir, .gguf or stored model id (default: --model when it is one)",
    )
    workload.add_argument("--num-prompts", type=positive_int, default=64, help="measured requests (default 64)")
    workload.add_argument("--num-warmups", type=non_negative_int, default=2, help="unmeasured requests first (default 2)")
    workload.add_argument("--seed", type=int, default=0)
    workload.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens (vLLM extension)")
    workload.add_argument("--temperature", type=float, default=0.0)
    workload.add_argument(
        "--extra-body", type=_json_object, default={},
        help='JSON object merged into every request, e.g. \'{"response_format": {"type": "json_object"}}\'',
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency", type=positive_int, default=None,
        help="closed loop: requests in flight (default 1); with --request-rate: the cap",
    )
    load.add_argument("--request-rate", type=_rate, default=None, help="open loop: mean req/s (or inf)")
    load.add_argument("--burstiness", type=_positive_float, default=1.0, help="gamma shape of arrivals (1: Poisson)")
    load.add_argument("--sweep-concurrency", default=None, help="comma list, one closed-loop run each")
    load.add_argument("--sweep-rate", default=None, help="comma list, one open-loop run each")
    out = parser.add_argument_group("output")
    out.add_argument("--slo", default=None, help="goodput SLO: ttft=MS,tpot=MS,e2e=MS (any subset)")
    out.add_argument("--json", default=None, help="write the report (sweeps: OUT_c{N}.json per point)")
    out.add_argument("--plot", default=None, help="sweeps: latency vs throughput PNG")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def serve_command(args: argparse.Namespace) -> int:
    import asyncio

    from tokenmill.bench.client import SamplingOptions
    from tokenmill.bench.metrics import SLO
    from tokenmill.bench.report import format_summary
    from tokenmill.bench.runner import LoadConfig, Target, run_benchmark
    from tokenmill.bench.sweep import SweepPoint, parse_list, plot_sweep, point_path, sweep_points

    try:
        slo = SLO.parse(args.slo) if args.slo else None
        tokenizer = _tokenizer(args)
        base = LoadConfig(
            concurrency=args.concurrency if args.concurrency or args.request_rate else 1,
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            num_warmups=args.num_warmups,
            seed=args.seed,
        )
        if args.sweep_concurrency and (args.concurrency or args.request_rate):
            raise ValueError("--sweep-concurrency sets the concurrency of each (closed-loop) run: drop "
                             "--concurrency / --request-rate")
        if args.sweep_rate and args.request_rate:
            raise ValueError("--sweep-rate sets the rate of each run: drop --request-rate")
        concurrencies = parse_list(args.sweep_concurrency, int) if args.sweep_concurrency else []
        rates = parse_list(args.sweep_rate, float) if args.sweep_rate else []
        points = sweep_points(base, concurrencies, rates) if concurrencies or rates else [SweepPoint("", base, 0)]
        if args.plot and len(points) < 2:
            raise ValueError("--plot needs a sweep (--sweep-concurrency or --sweep-rate)")
        workloads = [_workload(args, tokenizer, args.seed + p.seed_offset) for p in points]
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    target = Target(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        options=SamplingOptions(
            temperature=args.temperature, ignore_eos=args.ignore_eos, extra_body=tuple(args.extra_body.items())
        ),
        timeout_s=args.request_timeout,
    )
    reports: list[tuple[str, dict[str, Any]]] = []
    for i, (point, requests) in enumerate(zip(points, workloads, strict=True)):
        try:
            report = asyncio.run(
                run_benchmark(
                    target, requests, point.load, slo, tokenizer,
                    show_progress=not args.no_progress,
                    ready_timeout_s=args.ready_timeout if i == 0 else 0.0,
                )
            )
        except TimeoutError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        report["config"]["dataset"] = args.dataset
        print(format_summary(report))
        if args.json:
            path = Path(args.json) if not point.label else point_path(Path(args.json), point.label)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {path}")
        print()
        reports.append((point.label, report))
    if args.plot:
        plot_sweep(reports, Path(args.plot))
        print(f"wrote {args.plot}")
    return 1 if any(report["failed"] for _, report in reports) else 0


def _tokenizer(args: argparse.Namespace) -> Any:
    from tokenmill.bench.tokenizer import load_tokenizer

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    try:
        return load_tokenizer(args.model)
    except (ValueError, FileNotFoundError):
        return None  # a served name that is no local model: counts come from usage


def _workload(args: argparse.Namespace, tokenizer: Any, seed: int) -> list[Any]:
    from tokenmill.bench.workloads import (
        LengthRange,
        multi_turn_requests,
        random_requests,
        sharegpt_requests,
    )

    num = args.num_prompts + args.num_warmups
    if args.dataset == "random":
        output_len = LengthRange.parse(args.output_len or "128")
        requests = random_requests(num, LengthRange.parse(args.input_len), output_len, seed, tokenizer)
    elif args.dataset == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE")
        fixed = _fixed_length(args.output_len) if args.output_len else None
        requests = sharegpt_requests(args.dataset_path, num, seed, tokenizer, fixed)
    else:
        requests = multi_turn_requests(
            num,
            _fixed_length(args.output_len or "128"),
            seed,
            num_system_prompts=args.num_system_prompts,
            system_prompt_len=args.system_prompt_len,
            num_turns=args.num_turns,
            turn_len=args.turn_len,
            tokenizer=tokenizer,
        )
    if args.endpoint == "chat":
        requests[0].chat_messages()  # ValueError now, not once per request
    return requests


def _fixed_length(text: str) -> int:
    from tokenmill.bench.workloads import LengthRange

    length = LengthRange.parse(text)
    if length.low != length.high:
        raise ValueError(f"this workload takes a fixed --output-len, got {text!r}")
    return length.low


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def _rate(text: str) -> float:
    return math.inf if text.strip().lower() == "inf" else _positive_float(text)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
