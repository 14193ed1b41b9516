"""Peer comparison: the same workloads against tokenmill, vLLM (CPU) and HF transformers, in one run.

Every peer serves the same weights: the default model (SmolLM2-135M-Instruct), exported once
to an HF directory by `tokenmill models export` (vLLM has no GGUF loader; tokenmill serves
its GGUF, whose dequantized weights the export holds in bf16). All run in bf16.

Peers, one at a time (each server is started, measured, and stopped before the next):
  tokenmill   `tokenmill serve` with --max-num-seqs 64 --max-num-batched-tokens 512
  vllm        vLLM's OpenAI server from its own venv (VLLM_CPU_KVCACHE_SPACE=4, --max-num-seqs 64)
  hf          transformers `generate`, static batches of `concurrency` (hf_static.py), in-process

Workloads (`--workloads CxN,...`): closed loop, C requests in flight, N measured requests
after --warmups warm-ups (default 2), random token-id prompts of --input-len tokens, --output-len tokens each
(ignore_eos), temperature 0; the prompts come from one seed, so every peer gets the same
token ids. The HTTP peers are measured by `tokenmill.bench` (the `tokenmill bench serve`
code); the HF baseline's per-step times go through the same summary.

With --vllm-bench-check, vLLM's own `bench serve` client is run against the tokenmill server
with the first workload's shape, alternating with tokenmill's client (--check-pairs pairs, on
fresh prompts each), and the means are compared.

Writes one JSON per peer and workload plus peers.json to --out-dir, and prints a markdown
table: absolute numbers, and each peer's throughput and median TPOT as a ratio to tokenmill.
Kills every server it starts (its process group), also on errors and Ctrl-C.

    .venv/bin/python benchmarks/peers/compare.py --vllm-bench-check
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenmill.bench.client import SamplingOptions
from tokenmill.bench.runner import LoadConfig, Target, run_benchmark
from tokenmill.bench.tokenizer import load_tokenizer
from tokenmill.bench.workloads import BenchRequest, LengthRange, random_requests

MODEL = "smollm2-135m-instruct"
REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def server(name: str, command: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen]:
    """Runs `command` in its own process group; on exit SIGTERM the group, then SIGKILL."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as log_file:
        process = subprocess.Popen(
            command, env={**os.environ, **env}, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        print(f"[{name}] started pid {process.pid}: {' '.join(command)} (log {log})", file=sys.stderr)
        try:
            yield process
        finally:
            for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                if process.poll() is not None:
                    break
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(wait_s)
            print(f"[{name}] stopped (exit {process.returncode})", file=sys.stderr)


def workload(args: argparse.Namespace, concurrency: int, num: int, tokenizer: Any) -> list[BenchRequest]:
    length_in, length_out = LengthRange(args.input_len, args.input_len), LengthRange(args.output_len, args.output_len)
    return random_requests(num + args.warmups, length_in, length_out, args.seed + concurrency, tokenizer)


def bench_http(
    url: str, requests: list[BenchRequest], concurrency: int, warmups: int, ready_timeout_s: float
) -> dict[str, Any]:
    target = Target(url, MODEL, "completions", options=SamplingOptions(ignore_eos=True))
    load = LoadConfig(concurrency=concurrency, num_warmups=warmups)
    return asyncio.run(run_benchmark(target, requests, load, show_progress=False, ready_timeout_s=ready_timeout_s))


def vllm_bench_check(
    args: argparse.Namespace, url: str, concurrency: int, num: int, out_dir: Path, pair: int
) -> dict[str, Any]:
    """vLLM's `bench serve` client against `url` with the same workload shape."""
    script = Path(__file__).with_name("vllm_bench_serve.py")
    result_file = out_dir / f"vllm_client_on_tokenmill_{pair}.json"
    command = [
        args.vllm_python, str(script), "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", MODEL, "--tokenizer", str(args.hf_dir), "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "0", "--num-prompts", str(num), "--max-concurrency", str(concurrency),
        "--request-rate", "inf", "--ignore-eos", "--num-warmups", str(args.warmups), "--seed", str(args.seed + 1000 + pair),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
        "--save-result", "--result-dir", str(out_dir), "--result-filename", result_file.name,
    ]
    print(f"[vllm bench] {' '.join(command)}", file=sys.stderr)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    return json.loads(result_file.read_text())


def compare_clients(runs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Means over the (ours, theirs) pairs, each pair run back to back on the same server."""

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    keys = {
        "mean_ttft_ms": (("ttft_ms", "mean"), "mean_ttft_ms"),
        "median_ttft_ms": (("ttft_ms", "median"), "median_ttft_ms"),
        "mean_tpot_ms": (("tpot_ms", "mean"), "mean_tpot_ms"),
        "median_tpot_ms": (("tpot_ms", "median"), "median_tpot_ms"),
        "output_throughput": (("output_throughput", None), "output_throughput"),
    }
    rows = {}
    for name, ((key, stat), theirs_key) in keys.items():
        ours = [o[key][stat] if stat else o[key] for o, _ in runs]
        theirs = [t[theirs_key] for _, t in runs]
        rows[name] = {"tokenmill_bench": mean(ours), "vllm_bench": mean(theirs), "ratio": mean(ours) / mean(theirs),
                      "pairs": [[a, b] for a, b in zip(ours, theirs, strict=True)]}
    return {"metrics": rows, "within_10_percent": all(abs(r["ratio"] - 1) <= 0.10 for r in rows.values())}


def machine() -> dict[str, Any]:
    model = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")),
        platform.processor(),
    )
    return {"cpu": model, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    header = (
        "| workload | peer | out tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms "
        "| E2E p50 ms | tok/s vs tokenmill | TPOT p50 vs tokenmill |"
    )
    lines = [header, "|" + "---|" * 11]
    for name, peers in results.items():
        base = peers.get("tokenmill")
        for peer, r in peers.items():
            ratio_tps = f"{r['output_throughput'] / base['output_throughput']:.2f}x" if base else "-"
            ratio_tpot = f"{r['tpot_ms']['median'] / base['tpot_ms']['median']:.2f}x" if base else "-"
            lines.append(
                f"| {name} | {peer} | {r['output_throughput']:.1f} | {r['request_throughput']:.3f} "
                f"| {r['ttft_ms']['median']:.0f} | {r['ttft_ms']['p99']:.0f} | {r['tpot_ms']['median']:.1f} "
                f"| {r['tpot_ms']['p99']:.1f} | {r['e2e_ms']['median']:.0f} | {ratio_tps} | {ratio_tpot} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="tokenmill,vllm,hf", help="comma list of tokenmill, vllm, hf")
    parser.add_argument("--workloads", default="32x64,1x8", help="CONCURRENCYxPROMPTS, comma-separated")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hf-dir", type=Path, default=Path.home() / ".cache/tokenmill/export" / f"{MODEL}-hf")
    parser.add_argument("--vllm-python", default="/work/vllm-venv/bin/python", help="python of vLLM's own venv")
    parser.add_argument("--tokenmill-port", type=int, default=8100)
    parser.add_argument("--vllm-port", type=int, default=8200)
    parser.add_argument("--vllm-bench-check", action="store_true", help="also run vLLM's client against tokenmill")
    parser.add_argument(
        "--warmups", type=int, default=2,
        help="unmeasured requests before each workload (C = one full wave; see benchmarks/README.md)",
    )
    parser.add_argument("--check-pairs", type=int, default=2, help="alternating client pairs in the check")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks/results/peers")
    args = parser.parse_args(argv)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if unknown := set(peers) - {"tokenmill", "vllm", "hf"}:
        parser.error(f"unknown peers {sorted(unknown)}")
    try:
        workloads = [tuple(int(x) for x in w.split("x")) for w in args.workloads.split(",")]
    except ValueError:
        parser.error("--workloads is CONCURRENCYxPROMPTS,...")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    logs = args.out_dir / "logs"

    if not (args.hf_dir / "model.safetensors").is_file():
        subprocess.run(
            [str(REPO / ".venv/bin/tokenmill"), "models", "export", MODEL, "--format", "hf", "--out", str(args.hf_dir)],
            check=True,
        )
    tokenizer = load_tokenizer(str(args.hf_dir))
    requests = {(c, n): workload(args, c, n, tokenizer) for c, n in workloads}
    results: dict[str, dict[str, dict[str, Any]]] = {f"c={c} x {n}": {} for c, n in workloads}
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    client_check = None

    def record(peer: str, c: int, n: int, report: dict[str, Any]) -> None:
        results[f"c={c} x {n}"][peer] = report
        (args.out_dir / f"{peer}_c{c}_n{n}.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"[{peer}] c={c} x {n}: {report['output_throughput']:.1f} tok/s, failed {report['failed']}",
              file=sys.stderr)

    for peer in peers:
        if peer == "hf":
            from hf_static import StaticBatcher

            batcher = StaticBatcher(str(args.hf_dir))
            for c, n in workloads:
                record(peer, c, n, batcher.run(requests[(c, n)], c, args.warmups))
            del batcher
            continue
        if peer == "tokenmill":
            port = args.tokenmill_port
            command = [str(REPO / ".venv/bin/tokenmill"), "serve", MODEL, "--port", str(port), "--max-num-seqs", "64",
                       "--max-num-batched-tokens", "512", "--dtype", "bfloat16", "--log-level", "warning"]
            env: dict[str, str] = {}
        else:
            port = args.vllm_port
            command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.hf_dir),
                       "--served-model-name", MODEL, "--dtype", "bfloat16", "--max-num-seqs", "64",
                       "--port", str(port)]
            env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
        url = f"http://127.0.0.1:{port}"
        with server(peer, command, env, logs / f"{peer}.log"):
            for i, (c, n) in enumerate(workloads):
                record(peer, c, n, bench_http(url, requests[(c, n)], c, args.warmups, ready_timeout_s=900 if i == 0 else 0))
            if peer == "tokenmill" and args.vllm_bench_check:
                # Alternating pairs: on a shared machine one pair's noise can exceed 10%.
                c, n = workloads[0]
                pairs = []
                for pair in range(args.check_pairs):
                    check_requests = random_requests(
                        n + args.warmups, LengthRange(args.input_len, args.input_len),
                        LengthRange(args.output_len, args.output_len), args.seed + 1000 + pair, tokenizer,
                    )
                    ours = bench_http(url, check_requests, c, args.warmups, ready_timeout_s=0)
                    pairs.append((ours, vllm_bench_check(args, url, c, n, args.out_dir, pair)))
                client_check = compare_clients(pairs)
                print(f"[vllm bench] {json.dumps(client_check, indent=1)}", file=sys.stderr)

    summary = {
        "started_at": started,
        "finished_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "workload": {"input_len": args.input_len, "output_len": args.output_len, "ignore_eos": True,
                     "temperature": 0, "num_warmups": args.warmups, "prompts": "random token ids, same per peer"},
        "results": {w: {p: {k: r[k] for k in ("completed", "failed", "output_throughput", "request_throughput",
                                                "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "duration_s")}
                        for p, r in peers_.items()} for w, peers_ in results.items()},
        "vllm_bench_client_check": client_check,
    }
    (args.out_dir / "peers.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\n{started} on {summary['machine']['cpu']} ({summary['machine']['cores']} cores)\n")
    print(table(results))
    if client_check:
        print("\nvLLM `bench serve` vs tokenmill's client on the tokenmill server:")
        for k, v in client_check["metrics"].items():
            print(f"  {k}: tokenmill {v['tokenmill_bench']:.2f}, vllm {v['vllm_bench']:.2f}, ratio {v['ratio']:.3f}")
        print(f"  within 10%: {client_check['within_10_percent']}")
    failed = sum(r["failed"] for peers_ in results.values() for r in peers_.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
