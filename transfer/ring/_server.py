"""The daemon's end of a ring, sans I/O: descriptors into the one batch form of requests.

Everything in a descriptor is hostile: a batch is copied out of shared memory before it is
read (`Ring.pop_many`), and every field is checked here as the protocol checks a frame's.
Each descriptor becomes the request it stands for (or a BadRequest naming its fault); a
chain becomes its CopyV; a long clean run of copies stays arrays (`CopyRun`), planned as one
vector. The daemon's session integration (`server/_rings.py`) queues what comes out.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

import numpy as np

from .. import errors as E
from .. import protocol as P
from ._layout import FLAG_CHAIN, FLAG_SUM, MAX_CHAIN, Op

__all__ = ["CopyRun", "answers", "join_chains", "to_batch", "VECTOR_RUN"]

# Plain ints: IntEnum attribute lookups cost ~1 us each in a hot loop.
_NOP, _COPY, _FILL, _CHECKSUM, _FENCE, _RUN_GRAPH = (
    int(o) for o in (Op.NOP, Op.COPY, Op.FILL, Op.CHECKSUM, Op.FENCE, Op.RUN_GRAPH))
#: Plain copies in a row planned as one vector op (validated at once by `translate_many`).
VECTOR_RUN = 8


class CopyRun:
    """Copy descriptors that arrived together on a ring, as arrays: one vector op if all are valid."""

    __slots__ = ("ids", "dst", "src", "nbytes", "stream")

    def __init__(self, ids: np.ndarray, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, stream: int = 0) -> None:
        self.ids, self.dst, self.src, self.nbytes, self.stream = ids, dst, src, nbytes, stream

    def singles(self) -> list[P.Copy]:
        s = self.stream
        return [P.Copy(int(i), int(d), int(s_), int(n), s) for i, d, s_, n in zip(self.ids.tolist(), self.dst.tolist(), self.src.tolist(), self.nbytes.tolist())]


def answers(req: Any, ring: bool = False) -> int:
    """How many answers one queue entry owes: a CopyRun one per copy, a verified CopyV from a
    `ring` one per piece (a completion each), anything else one."""
    if type(req) is CopyRun:
        return len(req.ids)
    return len(req.nbytes) if ring and type(req) is P.CopyV and req.sums else 1


def _request(row: tuple[int, ...]) -> Any:
    """One descriptor as a request of the batch form (or a BadRequest naming its fault)."""
    op, rid, dst, src, nbytes, stream, flags, arg0, arg1, arg2 = row
    try:
        if rid == 0:
            raise E.InvalidField("a ring descriptor's id must be non-zero")
        if flags:
            raise E.InvalidField(f"unknown descriptor flags {flags:#x}")
        if op == _COPY:
            return P.Copy(rid, dst, src, nbytes, stream)
        if op == _FILL:
            P.check_ints(P.Fill, (dst, nbytes, arg0, stream))  # a value that is not a byte, in the decoder's words
            return P.Fill(rid, dst, nbytes, arg0, stream)
        if op == _CHECKSUM:
            return P.Checksum(rid, src, nbytes, stream)
        if op == _FENCE or op == _NOP:
            return P.Fence(rid, stream)
        if op == _RUN_GRAPH:
            if nbytes or arg1 or arg2:
                raise E.InvalidField("a RUN_GRAPH descriptor's nbytes, arg1 and arg2 must be zero")
            return P.RunGraph(rid, arg0, [src], [dst], False, stream)
        raise E.UnknownOperation(f"ring opcode {op} is not served over the ring (use the control socket)")
    except E.TransferError as exc:
        return P.BadRequest(rid, exc)


def _chained(chain: np.ndarray) -> Any:
    """A chain of COPY descriptors as the CopyV it stands for (or a BadRequest naming its
    fault); FLAG_SUM on every one of them: a verified CopyV (`sums`)."""
    rid, stream = int(chain["id"][0]), int(chain["stream"][0])
    sums = bool(chain["flags"][0] & FLAG_SUM)
    try:
        if rid == 0:
            raise E.InvalidField("a ring descriptor's id must be non-zero")
        if (chain["op"] != _COPY).any() or (chain["id"] != rid).any() or (chain["stream"] != stream).any():
            raise E.InvalidField("a descriptor chain must be COPYs of one id and one stream")
        if chain["flags"][-1] & FLAG_CHAIN:
            raise E.BatchTooLarge(f"a descriptor chain longer than {MAX_CHAIN}")
        if ((chain["flags"] & ~np.uint16(FLAG_CHAIN)) != (FLAG_SUM if sums else 0)).any():
            raise E.InvalidField("unknown descriptor flags in a chain (FLAG_SUM goes on all of a chain or none)")
        return P.CopyV(rid, chain["dst"].copy(), chain["src"].copy(), chain["nbytes"].copy(), stream, sums)
    except E.TransferError as exc:
        return P.BadRequest(rid, exc)


def join_chains(array: np.ndarray, route: int) -> tuple[list[tuple[Any, int]], np.ndarray]:
    """Descriptors in order, each chain (flagged rows and the unflagged one that ends it; a
    verified one may be a single FLAG_SUM row) joined into its CopyV, the rest as `to_batch`
    makes them; also the chain still open at the end (its rest is not in the ring yet),
    empty if none."""
    out: list[tuple[Any, int]] = []
    flagged = (array["flags"] & FLAG_CHAIN) != 0
    chains = (array["flags"] & (FLAG_CHAIN | FLAG_SUM)) != 0
    ends = np.flatnonzero(~flagged).tolist()  # rows that end a request
    starts = np.flatnonzero(chains).tolist()  # rows that a chain continues from, or is
    i, n = 0, len(array)
    while i < n:
        if not chains[i]:  # plain descriptors, up to the next chain
            f = bisect_left(starts, i)
            j = starts[f] if f < len(starts) else n
            out.extend(to_batch(None, array[i:j], route))
            i = j
            continue
        e = bisect_left(ends, i)
        if e == len(ends):  # open: its end has not arrived
            if n - i < MAX_CHAIN:
                return out, array[i:].copy()
            end = i + MAX_CHAIN - 1  # too long to be a request: refused, the rest starts anew
        else:
            end = min(ends[e], i + MAX_CHAIN - 1)
        out.append((_chained(array[i : end + 1]), route))
        i = end + 1
    return out, array[:0]


def to_batch(rows: list[tuple[int, ...]] | None, array: np.ndarray | None, route: int) -> list[tuple[Any, int]]:
    """Descriptors -> (request, route) pairs; long clean runs of copies stay arrays (`CopyRun`)."""
    if rows is not None:
        return [(_request(r), route) for r in rows]
    assert array is not None
    out: list[tuple[Any, int]] = []
    n = len(array)
    kinds = array["op"]
    cuts = (np.flatnonzero(kinds[1:] != kinds[:-1]) + 1).tolist() if n > 1 else []
    for a, b in zip([0, *cuts], [*cuts, n]):  # runs of one opcode
        d = array[a:b]
        st = d["stream"]
        if kinds[a] == _COPY and b - a >= VECTOR_RUN and not (d["flags"].any() or (d["id"] == 0).any() or (st != st[0]).any()):
            out.append((CopyRun(d["id"].copy(), d["dst"].copy(), d["src"].copy(), d["nbytes"].copy(), int(st[0])), route))
        else:
            out.extend((_request(r), route) for r in d.tolist())
    return out


