"""`tokenmill models pull NAME`, `models list` (the local model store), `models export` and
`models quantize`."""

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

    export = commands.add_parser("export", help="write a model as an HF transformers directory")
    export.add_argument("name", help="model id, .gguf file or HF directory")
    export.add_argument("--format", choices=["hf"], default="hf", help="output format (hf: safetensors + tokenizer)")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    export.set_defaults(handler=export_command)

    quantize = commands.add_parser("quantize", help="write a weight-quantized checkpoint that loads directly")
    quantize.add_argument("name", help="model id, .gguf file or HF directory")
    quantize.add_argument("--to", required=True, choices=["int8", "int4", "fp8"], help="weight scheme")
    quantize.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128], help="int4 group size")
    quantize.add_argument("--out", required=True, help="output directory")
    quantize.set_defaults(handler=quantize_command)


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


def export_command(args: argparse.Namespace) -> int:
    # torch and the loader only when exporting.
    from tokenmill.engine.loader.checkpoint import load_checkpoint
    from tokenmill.engine.loader.hf_export import export_hf
    from tokenmill.engine.loader.model_store import resolve_model

    try:
        checkpoint = load_checkpoint(resolve_model(args.name))
        out = export_hf(checkpoint, args.out, args.dtype)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{args.name}: exported to {out} ({args.format}, {args.dtype}, {size} bytes)")
    return 0


def quantize_command(args: argparse.Namespace) -> int:
    from tokenmill.engine.loader.checkpoint import load_checkpoint
    from tokenmill.engine.loader.model_store import resolve_model
    from tokenmill.engine.quantization.checkpoint import save_quantized
    from tokenmill.engine.quantization.config import QuantConfig

    try:
        config = QuantConfig(args.to, args.group_size)
        checkpoint = load_checkpoint(
            resolve_model(args.name), keep_int4=config.takes_gguf_int4, keep_int8=config.takes_gguf_int8
        )
        out = save_quantized(checkpoint, args.out, config)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{args.name}: quantized to {out} ({args.to}, {size} bytes)")
    return 0


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2
