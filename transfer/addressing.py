"""Virtual addresses and the mapping table.

A VA is a 64-bit integer ``segment_id << 40 | offset``. Translation is one
dict lookup plus integer compares, and nothing here touches memory: the
table only decides *whether* a range may be touched, and hands back the
segment so the caller can.

Segment ids are handed out by a counter and not reused until the 24-bit
space is exhausted, so a freed segment's VA is reported as freed rather than
silently aliasing a newer segment.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, Iterator, TypeVar

import numpy as np

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


class MappingTable(Generic[H]):
    """segment id -> Segment, with O(1) translation and ownership checks."""

    def __init__(self, max_segments: int = MAX_SEGMENT_ID) -> None:
        if not 0 < max_segments <= MAX_SEGMENT_ID:
            raise ValueError("max_segments out of range")
        self._segments: dict[int, Segment[H]] = {}
        self._next_id = 1
        self._max_segments = max_segments
        self._recycled: deque[int] = deque()
        #: Arena ids reserved for a session but not (or no longer) holding a segment.
        self._reserved: dict[int, Hashable] = {}

    def __len__(self) -> int:
        return len(self._segments)

    def __iter__(self) -> Iterator[Segment[H]]:
        return iter(list(self._segments.values()))

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
        """Insert under an id from `reserve_id` (for callers that name files after it first)."""
        if not 0 < nbytes <= MAX_SEGMENT_BYTES:
            raise InvalidAddress(f"segment size {nbytes} is outside 1..{MAX_SEGMENT_BYTES}")
        if len(self._segments) >= self._max_segments:
            raise QuotaExceeded(f"the daemon's table is full ({self._max_segments} segments)")
        if segment_id in self._segments or not 0 < segment_id < self._next_id:
            raise ValueError(f"segment id {segment_id} was not reserved")
        held = self._reserved.get(segment_id)
        if held is not None and held != owner:
            raise NotOwner(f"segment id {segment_id} is in another session's arena")
        seg: Segment[H] = Segment(segment_id, kind, nbytes, owner, handle, device)
        self._segments[segment_id] = seg
        return seg

    def reserve_id(self) -> int:
        """Next free id; ids are recycled oldest-first only once the counter runs out."""
        if self._next_id <= MAX_SEGMENT_ID:
            sid = self._next_id
            self._next_id += 1
            return sid
        while self._recycled:
            sid = self._recycled.popleft()
            if sid not in self._segments:
                return sid
        raise QuotaExceeded("segment id space exhausted")

    def reserve_block(self, count: int, owner: Hashable) -> int:
        """Reserve `count` consecutive ids for `owner` (a deferred-allocation arena); return the first."""
        if self._next_id + count - 1 > MAX_SEGMENT_ID:
            raise QuotaExceeded("segment id space exhausted: no room for another arena")
        first = self._next_id
        self._next_id += count
        for sid in range(first, first + count):
            self._reserved[sid] = owner
        return first

    def release_block(self, first: int, count: int) -> None:
        for sid in range(first, first + count):
            self._reserved.pop(sid, None)

    def remove(self, segment_id: int) -> Segment[H]:
        seg = self._segments.pop(segment_id)
        if self._next_id > MAX_SEGMENT_ID:
            self._recycled.append(segment_id)
        return seg

    def get(self, segment_id: int) -> Segment[H] | None:
        return self._segments.get(segment_id)

    def lookup(self, va: int, owner: Hashable) -> Segment[H]:
        """The segment that `va` names, if `owner` may use it."""
        if va < 0 or va > U64_MAX:
            raise InvalidAddress(f"VA {va:#x} is not a 64-bit unsigned integer")
        sid = va >> OFFSET_BITS
        seg = self._segments.get(sid)
        if seg is None:
            holder = self._reserved.get(sid)
            if holder is not None:
                if holder != owner:
                    raise NotOwner(f"VA {va:#x}: segment {sid} is in another session's arena")
                raise InvalidAddress(f"VA {va:#x}: a deferred allocation that was never defined (or was freed)")
            if 0 < sid < self._next_id:
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
    ) -> tuple[np.ndarray, np.ndarray, dict[int, Segment[H]]]:
        """Vectorised `translate` for uint64 arrays: (segment ids, offsets, {id: segment}).

        One Python-level lookup per *distinct* segment, NumPy compares for the rest,
        so a vector of 10,000 copies validates in microseconds per segment.
        """
        sids = vas >> np.uint64(OFFSET_BITS)
        offs = vas & np.uint64(OFFSET_MASK)
        segs: dict[int, Segment[H]] = {}
        for sid in np.unique(sids).tolist():
            segs[sid] = self.lookup(sid << OFFSET_BITS, owner)
        if len(segs) == 1:
            (only,) = segs.values()
            limits = np.uint64(only.nbytes)
            bad = (offs > limits) | (sizes > limits - np.minimum(offs, limits))
        else:
            table = {k: v.nbytes for k, v in segs.items()}
            limit_arr = np.fromiter((table[s] for s in sids.tolist()), np.uint64, len(sids))
            bad = (offs > limit_arr) | (sizes > limit_arr - np.minimum(offs, limit_arr))
        if bad.any():
            i = int(np.argmax(bad))
            self.translate(int(vas[i]), int(sizes[i]), owner)  # raises with the precise message
        return sids, offs, segs
