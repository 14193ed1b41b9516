"""`tokenmill` entry point: argparse with one module per command group.

Each group module (tokenmill.cli.models, later serve and bench) exposes
`register(subparsers)`, which adds its subcommand and sets `handler` on the parsed
arguments: a function `(argparse.Namespace) -> int` returning the exit status. Adding
a group is one line in COMMAND_GROUPS. The modules are imported by name when the
parser is built, and keep heavy imports (torch, the server) inside their handlers, so
`tokenmill --help` and `tokenmill models list` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import tokenmill

COMMAND_GROUPS: tuple[str, ...] = (
    "tokenmill.cli.models",
    "tokenmill.cli.serve",
    "tokenmill.cli.bench",
    "tokenmill.cli.plan",
    "tokenmill.cli.gateway",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="Self-hosted LLM inference.")
    parser.add_argument("--version", action="version", version=f"tokenmill {tokenmill.__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module_name in COMMAND_GROUPS:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    return int(handler(args))


if __name__ == "__main__":
    sys.exit(main())
