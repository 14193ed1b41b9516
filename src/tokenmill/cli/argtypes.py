"""argparse `type=` converters shared by the command groups: bad values exit with a clear message."""

from __future__ import annotations

import argparse
from typing import Any


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def speculative_config(text: str) -> Any:
    """A --speculative-config JSON object, validated (a SpeculativeConfig)."""
    from tokenmill.engine.spec_decode.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
