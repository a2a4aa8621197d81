"""Byte sizes, read and written the one way: the daemon's settings, its messages, the clients'
errors and `transfer-bench` all parse with `parse_size` and print with `fmt_bytes`."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["parse_size", "fmt_bytes"]

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)
_SIZE_EXP = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_size(raw: Any) -> int:
    """Bytes: an int, or a string like ``4096``, ``64MiB``, ``16G``, ``1.5G`` (K/M/G/T/P are
    1024-based; a fraction must come to whole bytes). ValueError says what a size looks like
    (the caller names the value and where it came from)."""
    if type(raw) is int:
        return raw
    if isinstance(raw, str):
        m = _SIZE_RE.match(raw)
        if m:
            num, unit, _ = m.groups()
            value = float(num) * (1024 ** _SIZE_EXP[unit.lower()])
            if value == int(value):
                return int(value)
            raise ValueError("not a whole number of bytes")
    raise ValueError("not a size (an integer number of bytes, or e.g. '64MiB', '16G')")


def fmt_bytes(n: int) -> str:
    """1536 -> '1.5 KiB', 65536 -> '64 KiB', 17 GiB -> '17 GiB', 100 -> '100 B'."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(x) < 1024 or unit == "TiB":
            return f"{int(x)} {unit}" if x.is_integer() else f"{x:.1f} {unit}"
        x /= 1024
    raise AssertionError("unreachable")
