"""`tokenmill serve [MODEL]`: the OpenAI-compatible server on one in-process engine."""

from __future__ import annotations

import argparse
import os
from typing import Any

from tokenmill.cli.argtypes import non_negative_int, port, positive_int, speculative_config
from tokenmill.engine.config import KV_CACHE_DTYPES

DEFAULT_MODEL = "smollm2-135m-instruct"
API_KEY_ENV = "TOKENMILL_API_KEY"


def register(subparsers: Any) -> None:
    """Add the `serve` command to the top-level parser's subparsers."""
    parser = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model id or path (default {DEFAULT_MODEL})")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: MODEL as given)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--kv-cache-memory-bytes", type=positive_int, default=1 << 30)
    engine.add_argument("--max-num-seqs", type=positive_int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    engine.add_argument("--max-model-len", type=positive_int, default=None, help="default: the model's context")
    engine.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    engine.add_argument(
        "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="K/V block storage: auto (the model's dtype), fp8 or int8 (one byte per element, "
        "~2x the tokens per budget)",
    )
    engine.add_argument(
        "--quantization", default=None, choices=["int8", "int4", "fp8"],
        help="quantization of the decoder projections (default: none; docs/quantization.md)",
    )
    engine.add_argument(
        "--quantization-group-size", type=int, default=32, choices=[32, 64, 128], help="int4 group size"
    )
    engine.add_argument(
        "--speculative-config", type=speculative_config, default=None, metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
        '\'{"method": "draft", "model": "self", "num_layers": 8}\' (default: off)',
    )
    server = parser.add_argument_group("server")
    server.add_argument("--max-queue-len", type=non_negative_int, default=512, help="waiting requests before 429")
    server.add_argument("--max-request-body-bytes", type=positive_int, default=8 * 1024 * 1024)
    server.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    server.add_argument(
        "--health-stall-timeout", type=float, default=60.0, help="seconds without a step (with work) before /health fails"
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(handler=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    # Heavy imports (torch via the engine, FastAPI) only when serving.
    import asyncio

    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.protocol import EngineClient
    from tokenmill.server.app import build_app
    from tokenmill.server.launcher import run
    from tokenmill.server.settings import ServerSettings

    settings = ServerSettings(
        served_model_name=args.served_model_name or args.model,
        model=args.model,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        max_queue_len=args.max_queue_len,
        max_body_bytes=args.max_request_body_bytes,
        health_stall_timeout_s=args.health_stall_timeout,
        drain_timeout_s=args.drain_timeout,
    )

    async def load_engine() -> EngineClient:
        engine = await asyncio.to_thread(
            AsyncEngine.from_args,
            args.model,
            dtype=args.dtype,
            device=args.device,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
            speculative=args.speculative_config,
        )
        await engine.start()
        return engine

    app = build_app(None, settings)
    return run(
        app, args.host, args.port, load_engine=load_engine, drain_timeout_s=args.drain_timeout, log_level=args.log_level
    )
