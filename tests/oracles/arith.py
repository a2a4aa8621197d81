"""checksum64 and a vector's per-segment bounds in NumPy and Python: the oracles of
transfer._native.checksum64 and segment_stats (native/util.c)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["checksum64", "segment_stats"]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
U64_MAX = (1 << 64) - 1


def checksum64(data: "np.ndarray | bytes | bytearray | memoryview") -> int:
    """checksum64 with NumPy."""
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    flat = arr.reshape(-1).view(np.uint8) if arr.flags.c_contiguous else np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    n = flat.nbytes
    whole = n & ~7
    total = int(flat[:whole].view("<u8").sum(dtype=np.uint64)) if whole else 0
    if whole != n:
        tail = np.zeros(8, np.uint8)
        tail[: n - whole] = flat[whole:]
        total += int(tail.view("<u8")[0])
    return (total + n * _GOLDEN) & _MASK


def segment_stats(vas: np.ndarray, sizes: np.ndarray, bits: int) -> list[tuple[int, int, int, int, int]]:
    """Per segment the VAs
    name, in order of first appearance, (id, first VA, lowest offset, highest end, largest
    size); an end past 64 bits counts as 2**64 - 1."""
    mask = (1 << bits) - 1
    seen: dict[int, list[int]] = {}
    for va, n in zip(vas.tolist(), sizes.tolist()):
        sid, off = va >> bits, va & mask
        end = min(off + n, U64_MAX)
        s = seen.get(sid)
        if s is None:
            seen[sid] = [va, off, end, n]
        else:
            s[1], s[2], s[3] = min(s[1], off), max(s[2], end), max(s[3], n)
    return [(sid, *s) for sid, s in seen.items()]  # type: ignore[misc]
