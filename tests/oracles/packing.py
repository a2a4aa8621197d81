"""The client's packing of requests into descriptors and its reaping of completions, in
Python: the oracles of `Queue.push_requests` and `Queue.pop_finished` (native/submission.c,
native/queue_type.c)."""

from __future__ import annotations

import struct
from typing import Any, Callable

import numpy as np

from transfer import protocol as P
from transfer._pending import Pending
from transfer.ring import FLAG_AFTER, FLAG_CHAIN, FLAG_SUM, REQUEST_DTYPE, Op, descriptors_of

__all__ = ["pack_vector", "PACKERS", "push_requests", "pop_finished"]

_COPY, _FILL, _CHECKSUM, _FENCE, _RUN_GRAPH = (int(o) for o in (Op.COPY, Op.FILL, Op.CHECKSUM, Op.FENCE, Op.RUN_GRAPH))
#: A run's results as pop_runs packs them: little-endian words.
_WORDS = np.dtype("<u8")

#: A descriptor's bytes, fields in layout order (REQUEST_DTYPE): op, flags, stream, id, dst,
#: src, nbytes, arg0, arg1, arg2. Packing with struct costs a fraction of a NumPy record.
_PACK = struct.Struct("<HHIQQQQQQQ").pack
assert struct.calcsize("<HHIQQQQQQQ") == REQUEST_DTYPE.itemsize
#: A descriptor's flags (at byte 2) and one of its words (arg2 at byte 56), for `FLAG_AFTER`.
_FLAGS, _WORD = struct.Struct("<H"), struct.Struct("<Q")


def pack_vector(op: int, chain: bool, rid: int, stream: int, dst: Any, src: Any, nbytes: np.ndarray, flags: int = 0) -> bytes:
    """A vector request's descriptors, one per range, made with NumPy (for the pure-Python
    twin of `push_requests`): dst and src are a VA for every range or a uint64 array,
    `chain` sets FLAG_CHAIN on all but the last, and `flags` goes on every one."""
    if not (0 <= op <= 0xFFFF and 0 <= stream <= 0xFFFFFFFF):
        raise OverflowError("stream or op out of range")
    if not isinstance(nbytes, np.ndarray):
        raise TypeError("nbytes: expected a 1-D uint64 array")
    for name, v in (("nbytes", nbytes), ("dst", dst), ("src", src)):
        if not isinstance(v, int) and (not isinstance(v, np.ndarray) or v.dtype != np.uint64 or v.ndim != 1):
            raise TypeError(f"{name}: expected a 1-D uint64 array")
        if isinstance(v, np.ndarray) and len(v) != len(nbytes):
            raise ValueError(f"{name}: {len(v)} ranges, expected {len(nbytes)}")
    d = np.zeros((len(nbytes), 8), np.uint64)
    head = op | flags << 16 | stream << 32
    d[:, 0] = head | FLAG_CHAIN << 16 if chain else head
    if len(d):
        d[-1, 0] = head
    d[:, 1], d[:, 2], d[:, 3], d[:, 4] = rid, dst, src, nbytes
    return d.tobytes()


#: Per ring-able request kind, for the pure-Python twin: its descriptors as bytes (one, or a
#: vector's, one per range). Raises struct.error or OverflowError for a field out of range.
PACKERS: dict[type, Callable[[Any], bytes]] = {
    P.Copy: lambda r: _PACK(_COPY, 0, r.stream, r.id, r.dst, r.src, r.nbytes, 0, 0, 0),
    P.CopyV: lambda r: pack_vector(_COPY, True, r.id, r.stream, r.dst, r.src, r.nbytes, FLAG_SUM if r.sums else 0),
    P.Fill: lambda r: _PACK(_FILL, 0, r.stream, r.id, r.dst, 0, r.nbytes, r.value, 0, 0),
    P.Checksum: lambda r: _PACK(_CHECKSUM, 0, r.stream, r.id, 0, r.src, r.nbytes, 0, 0, 0),
    # A checksum per range, each completed on its own under the one id (_Sums gathers them).
    P.ChecksumV: lambda r: pack_vector(_CHECKSUM, False, r.id, r.stream, 0, r.src, r.nbytes),
    P.Fence: lambda r: _PACK(_FENCE, 0, r.stream, r.id, 0, 0, 0, 0, 0, 0),
    P.RunGraph: lambda r: _PACK(_RUN_GRAPH, 0, r.stream, r.id, r.outputs[0], r.inputs[0], 0, r.graph, 0, 0),
}



def push_requests(outbox: Any, reqs: list[P.Request], start: int, kinds: dict[type, int], room: int, after: int,
                      pending: dict[int, Pending], outstanding: dict[int, Any], sums: Callable[..., Any]) -> tuple[int, int, int]:
    """`Queue.push_requests` in Python: from reqs[start],
    the whole requests whose descriptors fit in `room`, packed with struct and NumPy,
    published in one push, each noted as outstanding; (requests, descriptors, published)."""
    end, used, datas = start, 0, []
    while end < len(reqs):
        r = reqs[end]
        if type(r) not in kinds:
            raise TypeError(f"a {type(r).__name__} cannot take the ring")
        k = descriptors_of(r)
        if used + k > room:
            break
        if k:
            datas.append(PACKERS[type(r)](r))
        used += k
        end += 1
    data = b"".join(datas)
    if after and used:  # the first descriptor carries the fence
        first = bytearray(data)
        flags, = _FLAGS.unpack_from(first, 2)
        _FLAGS.pack_into(first, 2, flags | FLAG_AFTER)
        _WORD.pack_into(first, 56, after)
        data = bytes(first)
    published = outbox.push_buffer(data, used) if used else 0
    for r in reqs[start:end]:
        t = type(r)
        if t is not P.Wait:
            answers = sums() if t is P.ChecksumV else sums(True) if t is P.CopyV and r.sums else t is P.Checksum  # type: ignore[attr-defined]
            outstanding[r.id] = (pending[r.id], answers, descriptors_of(r))
    return end - start, used, published


def pop_finished(inbox: Any, outstanding: dict[int, Any], pending: dict[int, Pending],
                     array: Callable[[int], np.ndarray] | None = None) -> tuple[int, int, list[Any]]:
    """`Queue.pop_finished` in Python: pop every completion; until the first
    run that is not one of these, finish each lone success of an outstanding request whose
    answer is a bool (its value, or None), and (with `array`) each run of successes that is
    the whole answer of one that gathers a word per descriptor (a `_Sums` with no values
    yet), as array(n) filled with its n words; hand back (completions, descriptors freed,
    the other runs in order)."""
    total = freed = 0
    rest: list[Any] = []
    for run in inbox.pop_runs(0, 2, 1):
        rid, status, result, _, _, count, words = run
        total += count
        entry = outstanding.get(rid) if status == 0 and not rest else None
        value: Any = None
        if entry is not None:
            p, answers, took = entry
            if type(answers) is bool:
                value = result if answers else None
                entry = entry if count == 1 else None
            elif array is not None and took == count and getattr(answers, "values", None) == []:
                value = array(count)
                value[:] = np.frombuffer(words, _WORDS) if words is not None else result
            else:
                entry = None
        if entry is not None:
            del outstanding[rid]
            pending.pop(rid, None)
            p._finish(value, None)
            freed += took
        else:
            rest.append(run)
    return total, freed, rest


