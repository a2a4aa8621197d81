"""checksum64: the integrity check both sides compute over a byte range.

The wrapping sum of the range's little-endian uint64 words (the tail
zero-padded), mixed with its length. One pass at memory bandwidth, natively
(the ring workers' own loop, about four times NumPy's sum); tests/oracles/arith.py
states it in NumPy and the tests hold the two to one value.
It catches stale, shifted and foreign data; it is not cryptographic and
does not see two whole words swapped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._native import checksum64 as _native_checksum64

__all__ = ["checksum64", "checksum64_xp"]

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def checksum64(data: "np.ndarray | bytes | bytearray | memoryview") -> int:
    """checksum64 of a buffer (any dtype: its bytes are what count; a strided array's
    bytes in C order)."""
    try:
        return _native_checksum64(data)
    except (BufferError, ValueError):  # not C-contiguous (NumPy says ValueError): its bytes in order
        return _native_checksum64(np.ascontiguousarray(data))


def checksum64_xp(arr: Any, xp: Any) -> int:
    """checksum64 of an array of `xp`'s: host memory (NumPy) natively, as `checksum64`;
    device memory (CuPy) on the device, to the same value."""
    if xp is np:
        return checksum64(arr)
    flat = xp.ascontiguousarray(arr).reshape(-1).view(xp.uint8)
    n = int(flat.nbytes)
    whole = n & ~7
    total = int(flat[:whole].view(xp.uint64).sum(dtype=xp.uint64)) if whole else 0
    if whole != n:
        tail = bytes(xp.asnumpy(flat[whole:]) if hasattr(xp, "asnumpy") else flat[whole:]) + bytes(8 - (n - whole))
        total += int.from_bytes(tail, "little")
    return (total + n * _GOLDEN) & _MASK
