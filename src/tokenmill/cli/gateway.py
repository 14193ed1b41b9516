"""`tokenmill gateway --config fleet.yaml`: the fleet's front door (see docs/gateway.md)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tokenmill.cli.argtypes import port


def register(subparsers: Any) -> None:
    """Add the `gateway` command to the top-level parser's subparsers."""
    parser = subparsers.add_parser("gateway", help="route OpenAI-compatible traffic across a fleet of replicas")
    parser.add_argument("--config", required=True, help="fleet file (YAML or JSON; see docs/gateway.md)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=8080, help="port (default 8080)")
    parser.add_argument("--check", action="store_true", help="validate the config and exit")
    parser.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    parser.set_defaults(handler=gateway_command)


def gateway_command(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    import uvloop
    from aiohttp import web

    from tokenmill.gateway.app import build_app
    from tokenmill.gateway.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"tokenmill gateway: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.config}: ok ({len(config.pools)} pools, {sum(len(p.backends) for p in config.pools)} backends)")
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def serve() -> None:
        runner = web.AppRunner(build_app(config), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port, backlog=2048)
        await site.start()
        print(f"tokenmill gateway listening on http://{args.host}:{args.port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await runner.cleanup()

    uvloop.run(serve())
    return 0
