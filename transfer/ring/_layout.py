"""The ring's layout, declared once for Python: descriptors, completions, opcodes, flags,
the client's request kinds, and where the header, indices and waiter words live.

native/layout.h declares the same for C. The extension reports what it was built with
(`_native.layout()`), and `check_native` compares it with what is declared here when the
package is imported: a build whose C side drifted from this file fails at once, naming the
field, instead of exchanging descriptors the other side reads differently.

One session = one shared mapping holding two single-producer/single-consumer queues of
fixed-size slots: the request queue (client -> daemon, 64-byte descriptors) and the
completion queue (daemon -> client, 32-byte completions). docs/ring.md has the protocol.
"""

from __future__ import annotations

import mmap
import struct
from enum import IntEnum

import numpy as np

from .._native import layout as _native_layout

__all__ = [
    "Op", "REQUEST_DTYPE", "COMPLETION_DTYPE", "FLAG_CHAIN", "FLAG_AFTER", "FLAG_SUM", "MAX_CHAIN",
    "COMPLETION_DETAIL", "GOLDEN", "KIND_NAMES", "LAYOUT_VERSION", "MAGIC", "HEADER_SIZE", "MAX_CAPACITY",
    "geometry", "check_capacity", "check_native",
]


class Op(IntEnum):
    """Request opcodes."""

    NOP = 0
    COPY = 1
    FILL = 2
    CHECKSUM = 3
    FENCE = 4
    COMPUTE = 5
    #: A graph run with one input and one output, no profile: src is the input's VA, dst the
    #: output's, arg0 the graph's (`protocol.RunGraph`). Served by the daemon's loop.
    RUN_GRAPH = 6


# --- descriptor layouts -------------------------------------------------------
# Field order is the tuple order push()/pop() use; offsets are the byte layout.
# Little-endian, naturally aligned, no holes.
REQUEST_DTYPE = np.dtype(
    {
        "names": ["op", "id", "dst", "src", "nbytes", "stream", "flags", "arg0", "arg1", "arg2"],
        "formats": ["<u2", "<u8", "<u8", "<u8", "<u8", "<u4", "<u2", "<u8", "<u8", "<u8"],
        "offsets": [0, 8, 16, 24, 32, 4, 2, 40, 48, 56],
        "itemsize": 64,
    }
)
#: Request flag: the next descriptor belongs to the same request. A CopyV travels as COPY
#: descriptors sharing its id, this flag on all but the last; the daemon joins them into one
#: request (validated, executed and answered as the socket's CopyV: one completion).
FLAG_CHAIN = 1
#: Request flag: this descriptor, and every one after it, waits until the daemon has read
#: `arg2` frames from this session's control socket (its client counts every frame it sent,
#: hello included). A client sets it when it pushes while requests it sent on the socket
#: are still pending, so the ring's requests keep their place behind them.
FLAG_AFTER = 2
#: Request flag: a chain whose every descriptor has it is a verified CopyV (`sums`): it is
#: validated and executed as one, like any chain, and answers one completion per piece, in
#: order, whose result is the checksum64 of the bytes that piece copied; or, if it fails, one
#: completion only (its error), which frees the whole chain's slots.
FLAG_SUM = 4
#: Descriptors one chain may have (longer vectors take the socket).
MAX_CHAIN = 4096
COMPLETION_DTYPE = np.dtype(
    {
        "names": ["id", "status", "result", "flags", "aux"],
        "formats": ["<u8", "<i4", "<u8", "<u4", "<u8"],
        "offsets": [0, 8, 16, 12, 24],
        "itemsize": 32,
    }
)
#: Completion flag: the error's message follows on the control socket, as a reply with this id.
COMPLETION_DETAIL = 1
#: checksum64 is the wrapping sum of a range's little-endian words plus its length times this.
GOLDEN = 0x9E3779B97F4A7C15
#: The client's request kinds (native/layout.h K_*): which fields of a request go where in
#: its descriptors. A Wait marker takes no descriptor.
KIND_NAMES = ("WAIT", "COPY", "FILL", "CHECKSUM", "FENCE", "RUN_GRAPH", "COPYV", "CHECKSUMV")


def fields(dt: np.dtype) -> tuple[tuple[int, int, bool], ...]:
    """(offset, size, signed) of each field, in tuple order: what a native Queue packs by."""
    assert dt.names is not None and dt.fields is not None, "a structured dtype"
    return tuple((off, fdt.itemsize, fdt.kind == "i") for fdt, off in (dt.fields[name][:2] for name in dt.names))


# --- the mapping's header ------------------------------------------------------
LAYOUT_VERSION = 1
MAGIC = int.from_bytes(b"TRNSRING", "little")
HEADER_SIZE = 4096
LINE = 128  # >= the cache line (64 on x86-64; 128 covers adjacent-line prefetch and 128-byte lines)
# header line 0: geometry (written once by the creator), the closed flags, the pids
HEADER = struct.Struct("<QIIIIIIQQQII")  # magic ver hdr sq_cap cq_cap sq_slot cq_slot sq_off cq_off total spid cpid
OFF_SERVER_CLOSED = 64
OFF_CLIENT_CLOSED = 68
OFF_SERVER_PID, OFF_CLIENT_PID = 56, 60
# one cache line each: who writes it in parentheses
OFF_SQ_TAIL = 1 * LINE  # (client)  u64
OFF_SQ_HEAD = 2 * LINE  # (server)  u64
OFF_SQ_DATA_W = 3 * LINE  # server sleeps on "no requests"   u32 futex
OFF_SQ_SPACE_W = 4 * LINE  # client sleeps on "request queue full"  u32 futex
OFF_CQ_TAIL = 5 * LINE  # (server)
OFF_CQ_HEAD = 6 * LINE  # (client)
OFF_CQ_DATA_W = 7 * LINE  # client sleeps on "no completions"
OFF_CQ_SPACE_W = 8 * LINE  # server sleeps on "completion queue full"
MAX_CAPACITY = 1 << 24
PAGE = mmap.PAGESIZE


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def geometry(sq_cap: int, cq_cap: int) -> tuple[int, int, int]:
    """(request queue offset, completion queue offset, total bytes) of a mapping."""
    sq_off = HEADER_SIZE
    cq_off = _round_up(sq_off + sq_cap * REQUEST_DTYPE.itemsize, PAGE)
    total = _round_up(cq_off + cq_cap * COMPLETION_DTYPE.itemsize, PAGE)
    return sq_off, cq_off, total


def check_capacity(n: int, what: str) -> int:
    n = int(n)
    if n < 2 or n > MAX_CAPACITY or n & (n - 1):
        raise ValueError(f"{what} must be a power of two in 2..{MAX_CAPACITY}, got {n}")
    return n


# --- the other side ------------------------------------------------------------
def declared() -> dict[str, int]:
    """This file's layout in the terms `_native.layout()` reports."""
    out = {"desc_size": REQUEST_DTYPE.itemsize, "comp_size": COMPLETION_DTYPE.itemsize}
    for prefix, dt in (("desc", REQUEST_DTYPE), ("comp", COMPLETION_DTYPE)):
        assert dt.fields is not None
        out.update({f"{prefix}.{name}": int(spec[1]) for name, spec in dt.fields.items()})
    out.update({f"op.{op.name}": int(op) for op in Op})
    out.update({f"kind.{name}": i for i, name in enumerate(KIND_NAMES)})
    out.update(FLAG_CHAIN=FLAG_CHAIN, FLAG_AFTER=FLAG_AFTER, FLAG_SUM=FLAG_SUM, MAX_CHAIN=MAX_CHAIN,
               OFFSET_BITS=40, GOLDEN=GOLDEN - (1 << 64) if GOLDEN >= 1 << 63 else GOLDEN,
               COMPLETION_DETAIL=COMPLETION_DETAIL, **{"kind.COUNT": len(KIND_NAMES)})
    return out


def check_native(built: dict[str, int] | None = None) -> None:
    """Raise ImportError naming every difference between this layout and the extension's."""
    built = _native_layout() if built is None else built
    want = declared()
    diff = sorted(k for k in want.keys() | built.keys() if want.get(k) != built.get(k))
    if diff:
        shown = ", ".join(f"{k}: Python {want.get(k)} C {built.get(k)}" for k in diff)
        raise ImportError(f"transfer._native was built with another ring layout than transfer/ring/_layout.py ({shown}): rebuild it")


check_native()
