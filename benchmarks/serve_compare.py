"""Closed-loop streaming load on an OpenAI-compatible /v1/completions endpoint.

A thin wrapper over `tokenmill bench serve` (tokenmill.bench, the one load generator), kept
for its earlier command line: every flag is passed through, `--out FILE` is `--json FILE`,
and `--ignore-eos` is always on (every request generates exactly --output-len tokens).
Prompts are --input-len random token ids from the seed, sent as token-id lists.

    python benchmarks/serve_compare.py --base-url http://127.0.0.1:8100 \
        --model smollm2-135m-instruct --input-len 256 --output-len 128 \
        --concurrency 32 --num-prompts 96 --out benchmarks/results/serve_tokenmill_c32.json
"""

from __future__ import annotations

import sys

from tokenmill.cli.main import main as tokenmill_main


def bench_argv(argv: list[str]) -> list[str]:
    """This script's arguments as `tokenmill bench serve` arguments."""
    translated = []
    for arg in argv:
        if arg == "--out":
            translated.append("--json")
        elif arg.startswith("--out="):
            translated.append("--json=" + arg[len("--out="):])
        else:
            translated.append(arg)
    return ["bench", "serve", "--ignore-eos", *translated]


if __name__ == "__main__":
    sys.exit(tokenmill_main(bench_argv(sys.argv[1:])))
