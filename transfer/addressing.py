"""Virtual addresses and the mapping table.

A VA is a 64-bit integer ``segment_id << 40 | offset``. Translation is one
dict lookup plus integer compares, and nothing here touches memory: the
table only decides *whether* a range may be touched, and hands back the
segment so the caller can.

Segment ids are handed out by a cursor that moves through the 24-bit space
and wraps around, skipping ids in use (the way Linux hands out pids). A freed
id (a segment's, or a whole deferred-allocation arena's when its session
ends) is therefore not reused until the cursor has gone once round the whole
space: 16.7 million allocations later. Until then a freed segment's VA is
reported as freed rather than silently aliasing a newer segment, and after
that ids come back instead of running out.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Hashable, Iterator, TypeVar

import numpy as np

from ._native import segment_stats as _native_segment_stats
from .errors import (
    InvalidAddress,
    NotOwner,
    OutOfBounds,
    QuotaExceeded,
    SegmentFreed,
    UnknownSegment,
)

__all__ = [
    "OFFSET_BITS",
    "MAX_SEGMENT_BYTES",
    "MAX_SEGMENT_ID",
    "SegmentKind",
    "Segment",
    "MappingTable",
    "make_va",
    "split_va",
]

OFFSET_BITS = 40
OFFSET_MASK = (1 << OFFSET_BITS) - 1
_NP_BITS, _NP_MASK = np.uint64(OFFSET_BITS), np.uint64(OFFSET_MASK)
#: A segment is at most 1 TiB: its offsets must fit the low 40 bits.
MAX_SEGMENT_BYTES = 1 << OFFSET_BITS
MAX_SEGMENT_ID = (1 << (64 - OFFSET_BITS)) - 1
U64_MAX = (1 << 64) - 1


class SegmentKind(enum.IntEnum):
    HOST = 1  # shared memory on the server's host
    DEVICE = 2  # memory of one server device
    REMOTE = 3  # a buffer on another host, registered with NIXL


def make_va(segment_id: int, offset: int = 0) -> int:
    return (segment_id << OFFSET_BITS) | offset


def split_va(va: int) -> tuple[int, int]:
    return va >> OFFSET_BITS, va & OFFSET_MASK


H = TypeVar("H")


@dataclass(eq=False, slots=True)
class Segment(Generic[H]):
    """One row of the mapping table."""

    id: int
    kind: SegmentKind
    nbytes: int
    owner: Hashable
    handle: H
    device: int = -1
    #: Sessions the owner shared this segment with (they may name its VAs too).
    guests: set[Hashable] = field(default_factory=set)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def va(self) -> int:
        return self.id << OFFSET_BITS


#: One pass over a vector's VAs and sizes: per segment (id, first VA, lowest offset, highest end,
#: largest size), in order of first appearance (native/util.c).
_segment_stats = _native_segment_stats


class MappingTable(Generic[H]):
    """segment id -> Segment, with O(1) translation and ownership checks."""

    def __init__(self, max_segments: int = MAX_SEGMENT_ID, id_space: int = MAX_SEGMENT_ID) -> None:
        if not 0 < max_segments <= MAX_SEGMENT_ID:
            raise ValueError("max_segments out of range")
        if not 0 < id_space <= MAX_SEGMENT_ID:
            raise ValueError("id_space out of range")
        self._segments: dict[int, Segment[H]] = {}
        self._max_segments = max_segments
        #: Ids run 1..id_space (the full 24 bits, less in tests of the wrap-around).
        self._last_id = id_space
        #: The next id to try; every id below it has been handed out at least once.
        self._cursor = 1
        #: The cursor has gone round once: every id has been handed out.
        self._wrapped = False
        #: Arena blocks reserved for a session: first id -> (count, owner); `_starts` sorted.
        self._blocks: dict[int, tuple[int, Hashable]] = {}
        self._starts: list[int] = []
        #: Called whenever a segment goes or a session stops being allowed one: what was
        #: planned from earlier translations (graph runs' placements, server/_graphrun.py) is
        #: stale, and must not keep the memory alive either.
        self.on_change: Callable[[], None] = lambda: None

    def __len__(self) -> int:
        return len(self._segments)

    def __iter__(self) -> Iterator[Segment[H]]:
        return iter(list(self._segments.values()))

    @property
    def reserved_ids(self) -> int:
        """Ids held by arena blocks (whether or not a segment lives in them yet)."""
        return sum(count for count, _ in self._blocks.values())

    def add(
        self,
        kind: SegmentKind,
        nbytes: int,
        owner: Hashable,
        handle: H,
        device: int = -1,
    ) -> Segment[H]:
        return self.add_reserved(self.reserve_id(), kind, nbytes, owner, handle, device)

    def add_reserved(
        self,
        segment_id: int,
        kind: SegmentKind,
        nbytes: int,
        owner: Hashable,
        handle: H,
        device: int = -1,
    ) -> Segment[H]:
        """Insert under an id from `reserve_id` or an arena block (for callers that name files after it first)."""
        if not 0 < nbytes <= MAX_SEGMENT_BYTES:
            raise InvalidAddress(f"segment size {nbytes} is outside 1..{MAX_SEGMENT_BYTES}")
        if len(self._segments) >= self._max_segments:
            raise QuotaExceeded(f"the daemon's table is full ({self._max_segments} segments)")
        if segment_id in self._segments or not 0 < segment_id <= self._last_id or not (self._wrapped or segment_id < self._cursor):
            raise ValueError(f"segment id {segment_id} was not reserved")
        held = self._holder(segment_id)
        if held is not None and held != owner:
            raise NotOwner(f"segment id {segment_id} is in another session's arena")
        seg: Segment[H] = Segment(segment_id, kind, nbytes, owner, handle, device)
        self._segments[segment_id] = seg
        return seg

    # --- ids ------------------------------------------------------------------------------------
    def _block_at(self, sid: int) -> tuple[int, int, Hashable] | None:
        """The arena block holding `sid`: (first, count, owner), or None."""
        i = bisect.bisect_right(self._starts, sid) - 1
        if i < 0:
            return None
        first = self._starts[i]
        count, owner = self._blocks[first]
        return (first, count, owner) if sid < first + count else None

    def _holder(self, sid: int) -> Hashable | None:
        blk = self._block_at(sid)
        return None if blk is None else blk[2]

    def _conflict(self, first: int, count: int) -> int:
        """The first id in [first, first + count) that is in use (a segment or a block), or 0."""
        end = first + count
        hits: list[int] = []
        blk = self._block_at(first)
        if blk is not None:
            return first
        i = bisect.bisect_left(self._starts, first)
        if i < len(self._starts) and self._starts[i] < end:
            hits.append(self._starts[i])
        segs = self._segments
        if count <= len(segs):
            for sid in range(first, hits[0] if hits else end):
                if sid in segs:
                    return sid
        else:
            hits.extend(sid for sid in segs if first <= sid < end)
        return min(hits) if hits else 0

    def _take(self, count: int) -> int:
        """`count` consecutive unused ids at or after the cursor (wrapping); advance past them."""
        if count > self._last_id:
            raise QuotaExceeded(f"segment id space exhausted: {count} ids asked, the space has {self._last_id}")
        scanned = 0
        start = self._cursor
        while scanned <= self._last_id + count:
            if start + count - 1 > self._last_id:
                scanned += self._last_id + 1 - start
                start = 1
                self._wrapped = True
                continue
            used = self._conflict(start, count)
            if not used:
                self._cursor = start + count
                if self._cursor > self._last_id:
                    self._cursor, self._wrapped = 1, True
                return start
            blk = self._block_at(used)
            nxt = blk[0] + blk[1] if blk is not None else used + 1
            scanned += nxt - start
            start = nxt
        raise QuotaExceeded(f"segment id space exhausted: no {count} free consecutive ids among {self._last_id}")

    def reserve_id(self) -> int:
        """The next unused id; a freed id comes back only after the cursor has gone round."""
        return self._take(1)

    def reserve_block(self, count: int, owner: Hashable) -> int:
        """Reserve `count` consecutive ids for `owner` (a deferred-allocation arena); return the first."""
        first = self._take(count)
        self._blocks[first] = (count, owner)
        bisect.insort(self._starts, first)
        return first

    def release_block(self, first: int, count: int) -> None:
        """Give an arena's ids back (segments in it stay until removed)."""
        if self._blocks.pop(first, None) is not None:
            self._starts.pop(bisect.bisect_left(self._starts, first))

    def remove(self, segment_id: int) -> Segment[H]:
        seg = self._segments.pop(segment_id)
        self.on_change()
        return seg

    def touch(self) -> None:
        """Who may use a segment changed (a guest detached): plans made before are stale."""
        self.on_change()

    def get(self, segment_id: int) -> Segment[H] | None:
        return self._segments.get(segment_id)

    def lookup(self, va: int, owner: Hashable) -> Segment[H]:
        """The segment that `va` names, if `owner` may use it."""
        if va < 0 or va > U64_MAX:
            raise InvalidAddress(f"VA {va:#x} is not a 64-bit unsigned integer")
        sid = va >> OFFSET_BITS
        seg = self._segments.get(sid)
        if seg is None:
            holder = self._holder(sid)
            if holder is not None:
                if holder != owner:
                    raise NotOwner(f"VA {va:#x}: segment {sid} is in another session's arena")
                raise InvalidAddress(f"VA {va:#x}: segment {sid} of this session's arena is not defined (never defined, or freed)")
            if 0 < sid <= self._last_id and (self._wrapped or sid < self._cursor):
                raise SegmentFreed(f"VA {va:#x}: segment {sid} has been freed")
            raise UnknownSegment(f"VA {va:#x}: no segment {sid}")
        if seg.owner != owner and owner not in seg.guests:
            raise NotOwner(f"VA {va:#x}: segment {sid} belongs to another session")
        return seg

    def translate(self, va: int, nbytes: int, owner: Hashable) -> tuple[Segment[H], int]:
        """Check that [va, va + nbytes) lies in one segment `owner` owns; return (segment, offset)."""
        if nbytes < 0 or nbytes > U64_MAX:
            raise InvalidAddress(f"size {nbytes} is not a 64-bit unsigned integer")
        seg = self.lookup(va, owner)
        off = va & OFFSET_MASK
        # off + nbytes cannot overflow: both are bounded, and Python ints are exact.
        if nbytes > seg.nbytes - off:
            raise OutOfBounds(
                f"range [{va:#x}, +{nbytes}) runs past the end of segment {seg.id} "
                f"({seg.nbytes} bytes, offset {off})"
            )
        return seg, off

    def translate_many(
        self, vas: np.ndarray, sizes: np.ndarray, owner: Hashable
    ) -> tuple[np.ndarray, np.ndarray, dict[int, Segment[H]], list[tuple[int, int, int]]]:
        """Vectorised `translate` for uint64 arrays: (segment ids, offsets, {id: segment},
        hulls), the hulls being per segment the (id, start, end) spanning every range in it
        (the planner's conservative hazard ranges; none for empty arrays).

        One Python-level lookup per *distinct* segment; one native pass over the arrays
        (`segment_stats`) finds each segment's first VA and what bounds its ranges, and two
        NumPy calls make the ids and offsets. NumPy's fixed cost per call (a few microseconds
        here, whatever the length) and a Python loop over every range were most of it before.
        """
        sids = vas >> _NP_BITS
        offs = vas & _NP_MASK
        segs: dict[int, Segment[H]] = {}
        hulls = []
        bad = False
        # One pass (native) gives each segment its first VA, in order, and what bounds its
        # ranges: each is looked up with the first VA that names it, in order, so a refusal
        # names the first range that fails, as a one-by-one translation would.
        for sid, first, lo, hi, big in _segment_stats(vas, sizes, OFFSET_BITS):
            seg = segs[sid] = self.lookup(first, owner)
            # Offsets are below 2**OFFSET_BITS, so with every size within the segment no end
            # wraps, and the highest end decides; else `_refuse` finds the first bad range.
            bad = bad or big > seg.nbytes or hi > seg.nbytes
            hulls.append((sid, lo, hi))
        if bad:
            table = {k: v.nbytes for k, v in segs.items()}
            limit_arr = np.fromiter((table[s] for s in sids.tolist()), np.uint64, len(sids))
            self._refuse(vas, sizes, offs + sizes, limit_arr, owner)
        hulls.sort()
        return sids, offs, segs, hulls

    def _refuse(self, vas: np.ndarray, sizes: np.ndarray, ends: np.ndarray, limits: Any, owner: Hashable) -> None:
        """Raise `translate`'s precise error for the first range past its segment's end (a
        size past the segment, or an end past it: with the size within, the end cannot wrap)."""
        i = int(np.argmax((sizes > limits) | (ends > limits)))
        self.translate(int(vas[i]), int(sizes[i]), owner)
        raise AssertionError("a range past its segment translated")  # (translate raised above)
