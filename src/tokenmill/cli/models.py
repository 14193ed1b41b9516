"""`tokenmill models pull NAME` and `tokenmill models list`: the local model store."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tokenmill.engine.loader.model_store import KNOWN_MODELS, ModelStore, stderr_progress


def register(subparsers: Any) -> None:
    """Add the `models` command group to the top-level parser's subparsers."""
    parser = subparsers.add_parser("models", help="pull and list models in the local store")
    parser.set_defaults(handler=lambda args: _usage(parser))
    commands = parser.add_subparsers(title="models commands", metavar="COMMAND")

    pull = commands.add_parser("pull", help="download a known model into the store")
    pull.add_argument("name", help=f"model id, one of: {', '.join(sorted(KNOWN_MODELS))}")
    pull.set_defaults(handler=pull_command)

    list_parser = commands.add_parser("list", help="list stored models")
    list_parser.set_defaults(handler=list_command)


def pull_command(args: argparse.Namespace) -> int:
    store = ModelStore()
    try:
        stored = store.pull(args.name, progress=stderr_progress(f"pulling {args.name}"))
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{stored.name}: {stored.path} ({stored.size_bytes} bytes, sha256 {stored.sha256})")
    return 0


def list_command(args: argparse.Namespace) -> int:
    store = ModelStore()
    models = store.list()
    if not models:
        print(f"no models in {store.models_dir} (pull one of: {', '.join(sorted(KNOWN_MODELS))})")
        return 0
    rows = [("NAME", "SIZE", "SHA256", "PATH")]
    rows += [(m.name, f"{m.size_bytes / 1e6:.1f} MB", m.sha256[:12], str(m.path)) for m in models]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            + "  "
            + row[3]
        )
    return 0


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2
