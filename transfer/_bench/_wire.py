"""The small messages every hand-rolled channel sends: a group's header and its ack.

Shared by `channels` and `_iceoryx` (which carries the same fields in iceoryx2's user header).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

__all__ = ["VERIFY", "BYE", "HDR", "ACK", "pack_header", "unpack_header"]

VERIFY = 1
BYE = 2

HDR = struct.Struct("<iqii")  # producer index, group, slot, flags; then batch x u64 expected
ACK = struct.Struct("<qi")  # group, ok


def pack_header(idx: int, g: int, slot: int, flags: int, expected: Sequence[int] | None) -> bytes:
    h = HDR.pack(idx, g, slot, flags)
    if expected:
        h += struct.pack(f"<{len(expected)}Q", *expected)
    return h


def unpack_header(b: bytes) -> tuple[int, int, int, int, tuple[int, ...] | None]:
    idx, g, slot, flags = HDR.unpack_from(b, 0)
    n = (len(b) - HDR.size) // 8
    expected = struct.unpack_from(f"<{n}Q", b, HDR.size) if n else None
    return idx, g, slot, flags, expected
