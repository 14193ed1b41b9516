"""`tokenmill plan`: replicas and cost for one model on one accelerator (see tokenmill.plan)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

_UNITS = {"": 1e9, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def register(subparsers: Any) -> None:
    """Add the `plan` command to the top-level parser's subparsers."""
    parser = subparsers.add_parser(
        "plan",
        help="capacity plan: memory, concurrency, replicas and cost",
        description="Capacity plan for one model on one kind of accelerator. The formulas are in "
        "tokenmill/plan/planner.py.",
    )
    model = parser.add_argument_group("model")
    model.add_argument("--model", default=None, help="HF config.json (or its directory) or a known model id")
    model.add_argument("--params", type=float, default=None, help="instead of --model: parameter count (e.g. 8.03e9)")
    model.add_argument("--layers", type=int, default=None)
    model.add_argument("--kv-heads", type=int, default=None)
    model.add_argument("--head-dim", type=int, default=None)
    model.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp8", "int8", "int4"], help="weights")
    model.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp16", "fp8", "int8"])
    hardware = parser.add_argument_group("hardware")
    hardware.add_argument("--gpu-memory", required=True, type=parse_bytes, help="per accelerator: 80GB, 80GiB, ...")
    hardware.add_argument("--memory-utilization", type=float, default=0.9, help="default 0.9")
    hardware.add_argument("--overhead", type=parse_bytes, default=0, help="reserved for activations (default 0)")
    hardware.add_argument("--bandwidth", type=parse_bandwidth, default=None, help="memory bandwidth: 3.35TB/s or GB/s")
    hardware.add_argument("--tflops", type=float, default=None, help="dense TFLOP/s at the weight dtype (roofline TTFT)")
    hardware.add_argument("--gpus-per-replica", type=int, default=1)
    hardware.add_argument("--block-size", type=int, default=16, help="KV block tokens (default 16)")
    traffic = parser.add_argument_group("traffic")
    traffic.add_argument("--peak-qps", type=float, required=True)
    traffic.add_argument("--avg-qps", type=float, default=None, help="monthly volume (default: the peak)")
    traffic.add_argument("--input-len", type=int, required=True, help="p50 prompt tokens")
    traffic.add_argument("--output-len", type=int, required=True, help="p50 output tokens")
    traffic.add_argument("--input-len-p99", type=int, default=None, help="default: --input-len")
    traffic.add_argument("--output-len-p99", type=int, default=None, help="default: --output-len")
    traffic.add_argument("--slo", default=None, help="ttft=MS,tpot=MS (p99 targets)")
    traffic.add_argument("--headroom", type=float, default=0.3, help="spare capacity, 0.2-0.4 (default 0.3)")
    traffic.add_argument(
        "--bench", action="append", default=[], help="a `tokenmill bench serve --json` report (repeatable)"
    )
    prices = parser.add_argument_group("prices")
    prices.add_argument("--gpu-hour-price", type=float, default=None, help="$ per accelerator-hour")
    prices.add_argument("--api-input-price", type=float, default=None, help="hosted API $ per 1M input tokens")
    prices.add_argument("--api-output-price", type=float, default=None, help="hosted API $ per 1M output tokens")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(handler=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    from tokenmill.plan.planner import Hardware, Prices, Traffic, make_plan

    try:
        model = _model(args)
        slo = _slo(args.slo)
        reports = [_read_report(path) for path in args.bench]
        plan = make_plan(
            model,
            args.dtype,
            args.kv_dtype,
            Hardware(
                memory_bytes=int(args.gpu_memory),
                memory_utilization=args.memory_utilization,
                overhead_bytes=int(args.overhead),
                bandwidth_bytes_s=args.bandwidth,
                flops=None if args.tflops is None else args.tflops * 1e12,
                gpus_per_replica=args.gpus_per_replica,
            ),
            Traffic(
                peak_qps=args.peak_qps,
                avg_qps=args.avg_qps,
                input_len_p50=args.input_len,
                output_len_p50=args.output_len,
                input_len_p99=args.input_len_p99 or args.input_len,
                output_len_p99=args.output_len_p99 or args.output_len,
                slo_ttft_ms=slo.get("ttft"),
                slo_tpot_ms=slo.get("tpot"),
            ),
            Prices(args.gpu_hour_price, args.api_input_price, args.api_output_price),
            reports,
            headroom=args.headroom,
            block_size=args.block_size,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(format_plan(plan.to_dict()))
    return 0


def format_plan(plan: dict[str, Any]) -> str:
    perf = plan["performance"]

    def money(value: float | None) -> str:
        return "-" if value is None else f"${value:,.0f}"

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    rows = [
        ("model", f"{plan['model']} ({plan['num_params'] / 1e9:.2f} B params)"),
        ("weights", f"{plan['weights_bytes'] / 1e9:.2f} GB"),
        ("KV per token", f"{plan['kv_bytes_per_token']:,} bytes"),
        ("KV cache", f"{plan['kv_cache_bytes'] / 1e9:.2f} GB = {plan['kv_capacity_tokens']:,} tokens"),
        ("max concurrency (p99 lengths)", str(plan["max_concurrency"])),
        (
            f"per replica ({perf['source']})",
            f"{perf['request_throughput']:.3f} req/s at concurrency {perf['concurrency']}, "
            f"p99 TTFT {ms(perf['ttft_p99_ms'])}, p99 TPOT {ms(perf['tpot_p99_ms'])}, "
            f"SLO {'met' if perf['meets_slo'] else 'NOT met'}",
        ),
        (f"replicas ({plan['headroom']:.0%} headroom)", str(plan["replicas"])),
        ("monthly tokens in / out", f"{plan['monthly_input_tokens']:,.0f} / {plan['monthly_output_tokens']:,.0f}"),
        ("monthly cost self-hosted", money(plan["monthly_cost_self_hosted"])),
        ("monthly cost API", money(plan["monthly_cost_api"])),
        (
            "break-even tokens / month",
            "-" if plan["break_even_tokens_per_month"] is None else f"{plan['break_even_tokens_per_month']:,.0f}",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    lines += [f"note: {note}" for note in plan["notes"]]
    return "\n".join(lines)


def parse_bytes(text: str) -> float:
    """'80GB' (1e9), '80GiB' (2**30), '512MB', '80' (GB)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 80GB or 80GiB, got {text!r}")
    return float(match.group(1)) * _UNITS[unit]


def parse_bandwidth(text: str) -> float:
    """'3.35TB/s', '3350GB/s' or '3350' (GB/s) -> bytes/s."""
    value = parse_bytes(text.removesuffix("/s"))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"bandwidth must be positive, got {text!r}")
    return value


def _model(args: argparse.Namespace) -> Any:
    from tokenmill.plan.model import ModelShape, resolve_model

    explicit = (args.params, args.layers, args.kv_heads, args.head_dim)
    if args.model is not None:
        if any(v is not None for v in explicit):
            raise ValueError("give --model or the explicit --params/--layers/--kv-heads/--head-dim, not both")
        return resolve_model(args.model)
    if any(v is None for v in explicit):
        raise ValueError("give --model, or all of --params, --layers, --kv-heads and --head-dim")
    return ModelShape("custom", int(args.params), args.layers, args.kv_heads, args.head_dim)


def _slo(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    values: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition("=")
        if not sep or name not in ("ttft", "tpot"):
            raise ValueError(f"--slo is ttft=MS,tpot=MS (any subset), got {text!r}")
        try:
            values[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo {name} must be milliseconds, got {value!r}") from None
    return values


def _read_report(path: str) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"bench report not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a bench report")
    return data
