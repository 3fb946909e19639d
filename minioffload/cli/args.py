"""argparse types the commands share: a parameter count ("7B") and a size in bytes ("64MB"), each refused with a
message that shows how to write one."""

from __future__ import annotations

import argparse
import re

from ..units import parse_bytes

_SUFFIXES = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """'7B' -> 7e9, '124M' -> 1.24e8, '1.5e9' -> 1.5e9."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmbt]?)\s*", text.lower())
    if not match or not 0 < float(match[1]) * _SUFFIXES[match[2]] < 1e18:  # finite, and below a billion billion
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive parameter count; write e.g. 7B, 124M, 1.5e9")
    return float(match[1]) * _SUFFIXES[match[2]]


def bytes_arg(text: str) -> int:
    """argparse's type for a size in bytes (units.parse_bytes)."""
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
