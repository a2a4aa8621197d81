"""Property tests for VA translation: right answers in bounds, the right error out of it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from transfer import errors as E
from transfer.addressing import OFFSET_BITS, MappingTable, SegmentKind, make_va, split_va

sizes = st.integers(1, 1 << 32)


@st.composite
def table_with_segments(draw: st.DrawFn) -> tuple[MappingTable[str], list]:
    t: MappingTable[str] = MappingTable()
    segs = [t.add(SegmentKind.HOST, draw(sizes), draw(st.sampled_from(["a", "b"])), "h") for _ in range(draw(st.integers(1, 6)))]
    return t, segs


@given(table_with_segments(), st.data())
def test_in_bounds_ranges_translate_exactly(tw: tuple, data: st.DataObject) -> None:
    t, segs = tw
    seg = data.draw(st.sampled_from(segs))
    off = data.draw(st.integers(0, seg.nbytes))
    n = data.draw(st.integers(0, seg.nbytes - off))
    got, got_off = t.translate(seg.va + off, n, seg.owner)
    assert got is seg and got_off == off


@given(table_with_segments(), st.data())
def test_out_of_bounds_ranges_are_refused(tw: tuple, data: st.DataObject) -> None:
    t, segs = tw
    seg = data.draw(st.sampled_from(segs))
    off = data.draw(st.integers(0, (1 << OFFSET_BITS) - 1))
    n = data.draw(st.integers(0, 2**64 - 1))
    if off + n <= seg.nbytes:
        n = seg.nbytes - off + 1 + data.draw(st.integers(0, 1000))
    with pytest.raises(E.OutOfBounds):
        t.translate(seg.va + off, n, seg.owner)


@given(table_with_segments(), st.data())
def test_other_sessions_segments_are_refused(tw: tuple, data: st.DataObject) -> None:
    t, segs = tw
    seg = data.draw(st.sampled_from(segs))
    other = "b" if seg.owner == "a" else "a"
    with pytest.raises(E.NotOwner):
        t.translate(seg.va, 1, other)


@given(table_with_segments(), st.data())
def test_freed_and_unknown_segments(tw: tuple, data: st.DataObject) -> None:
    t, segs = tw
    seg = data.draw(st.sampled_from(segs))
    t.remove(seg.id)
    with pytest.raises(E.SegmentFreed):
        t.translate(seg.va, 1, seg.owner)
    unknown = data.draw(st.integers(len(segs) + 1, (1 << (64 - OFFSET_BITS)) - 1))
    with pytest.raises(E.UnknownSegment):
        t.translate(make_va(unknown, 0), 1, seg.owner)
    with pytest.raises(E.UnknownSegment):
        t.translate(0, 1, seg.owner)  # id 0 is never handed out


@given(st.integers(-(2**70), -1) | st.integers(2**64, 2**70))
def test_values_beyond_64_bits_are_invalid(bad: int) -> None:
    t: MappingTable[str] = MappingTable()
    t.add(SegmentKind.HOST, 10, "a", "h")
    with pytest.raises(E.InvalidAddress):
        t.translate(bad, 1, "a")
    with pytest.raises(E.InvalidAddress):
        t.translate(make_va(1), bad, "a")


@given(st.integers(1, (1 << (64 - OFFSET_BITS)) - 1), st.integers(0, (1 << OFFSET_BITS) - 1))
def test_va_arithmetic(sid: int, off: int) -> None:
    assert split_va(make_va(sid, off)) == (sid, off)


@given(table_with_segments(), st.data())
def test_vector_translation_agrees_with_scalar(tw: tuple, data: st.DataObject) -> None:
    t, segs = tw
    owner = segs[0].owner
    mine = [s for s in segs if s.owner == owner]
    n = data.draw(st.integers(1, 40))
    vas, lens, expect_err = [], [], None
    for _ in range(n):
        s = data.draw(st.sampled_from(mine))
        off = data.draw(st.integers(0, s.nbytes + 10))
        # Now and then a size whose end wraps 64 bits (the vector check must not be fooled).
        # (2**64 - k with k <= off + 10: the end, taken mod 2**64, lands at or just past the start.)
        ln = data.draw(st.one_of(st.integers(0, s.nbytes + 10), st.integers(1, off + 10).map(lambda k: (1 << 64) - k)))
        vas.append(s.va + off)
        lens.append(ln)
    for va, ln in zip(vas, lens):
        try:
            t.translate(va, ln, owner)
        except E.AddressError as exc:
            expect_err = expect_err or type(exc)
    if expect_err is None:
        sids, offs, table, hulls = t.translate_many(np.array(vas, np.uint64), np.array(lens, np.uint64), owner)
        assert [table[int(i)].va + int(o) for i, o in zip(sids, offs)] == vas
        # Per segment, the hull spans exactly its ranges: from the lowest start to the highest end.
        want: dict[int, tuple[int, int]] = {}
        for va, ln in zip(vas, lens):
            sid, off = va >> OFFSET_BITS, va & ((1 << OFFSET_BITS) - 1)
            lo, hi = want.get(sid, (off, off + ln))
            want[sid] = (min(lo, off), max(hi, off + ln))
        assert hulls == [(sid, *want[sid]) for sid in sorted(want)]
    else:
        with pytest.raises(expect_err):
            t.translate_many(np.array(vas, np.uint64), np.array(lens, np.uint64), owner)


def test_ids_are_not_reused_while_the_space_lasts() -> None:
    t: MappingTable[str] = MappingTable()
    a = t.add(SegmentKind.HOST, 10, "a", "h")
    t.remove(a.id)
    b = t.add(SegmentKind.HOST, 10, "a", "h")
    assert b.id != a.id
    with pytest.raises(E.SegmentFreed):
        t.lookup(a.va, "a")


def test_ids_come_back_once_the_cursor_has_gone_round() -> None:
    """Freed ids and released arenas return; not before every other id has been used once."""
    t: MappingTable[str] = MappingTable(id_space=64)
    blocks = [t.reserve_block(16, f"s{i}") for i in range(4)]
    assert blocks == [1, 17, 33, 49]
    with pytest.raises(E.QuotaExceeded):
        t.reserve_block(16, "s4")
    with pytest.raises(E.QuotaExceeded):
        t.reserve_id()
    seg = t.add_reserved(20, SegmentKind.DEVICE, 10, "s1", "h")
    t.release_block(17, 16)  # session s1 ends: its arena returns, its segment stays until freed
    assert t.reserve_block(8, "s5") == 21  # around past 1..16 (held) and 20 (a live segment)
    t.remove(seg.id)
    with pytest.raises(E.SegmentFreed):
        t.lookup(seg.va, "s1")
    for sid in (29, 30):
        assert t.reserve_id() == sid
        t.add_reserved(sid, SegmentKind.HOST, 10, "s9", "h")
    # 31, 32 are too few before the next arena: the cursor wraps and finds 17..20 (20 freed).
    assert t.reserve_block(4, "s6") == 17
    with pytest.raises(E.QuotaExceeded):
        t.reserve_block(3, "s7")
    for first in (1, 33, 49):
        t.release_block(first, 16)
    # Endless open/close cycles never exhaust the space.
    for i in range(1000):
        first = t.reserve_block(16, i)
        t.release_block(first, 16)


def test_arena_ids_are_held_by_block_not_by_id() -> None:
    """A huge arena costs the table one entry, not one per id."""
    t: MappingTable[str] = MappingTable()
    first = t.reserve_block(1 << 22, "a")
    assert t.reserved_ids == 1 << 22
    with pytest.raises(E.NotOwner):
        t.lookup((first + 5) << 40, "b")
    with pytest.raises(E.InvalidAddress):
        t.lookup((first + 5) << 40, "a")
    with pytest.raises(E.NotOwner):
        t.add_reserved(first + 5, SegmentKind.DEVICE, 10, "b", "h")
    t.add_reserved(first + 5, SegmentKind.DEVICE, 10, "a", "h")
    t.release_block(first, 1 << 22)
    assert t.reserved_ids == 0


_U64 = st.integers(0, (1 << 64) - 1)


@given(st.lists(st.tuples(st.sampled_from([0, 1, 2, 7, (1 << 24) - 1]), st.integers(0, (1 << OFFSET_BITS) - 1),
                          st.one_of(st.integers(0, 1 << 20), _U64)), max_size=40))
def test_segment_stats_native_matches_python(ranges: list[tuple[int, int, int]]) -> None:
    """`translate_many`'s one pass (native `segment_stats`) and its pure-Python twin give,
    per segment in order of first appearance, its first VA, the lowest offset, the highest
    end (an end past 64 bits as 2**64 - 1) and the largest size: what NumPy says of the same
    ranges, one segment at a time."""
    from oracles.arith import segment_stats as _py_segment_stats
    from transfer import _native

    vas = np.array([make_va(sid, off) for sid, off, _ in ranges], np.uint64)
    sizes = np.array([n for _, _, n in ranges], np.uint64)
    py = _py_segment_stats(vas, sizes, OFFSET_BITS)
    want = []
    for sid in dict.fromkeys(s for s, _, _ in ranges):  # in order of first appearance
        mine = [(off, n) for s, off, n in ranges if s == sid]
        want.append((sid, make_va(sid, mine[0][0]), min(o for o, _ in mine), min(max(o + n for o, n in mine), (1 << 64) - 1),
                     max(n for _, n in mine)))
    assert py == want
    native = _native
    if native is not None:
        assert native.segment_stats(vas, sizes, OFFSET_BITS) == want


def test_segment_stats_takes_only_uint64() -> None:
    from transfer import _native

    native = _native
    if native is None:
        pytest.skip("extension not built")
    v = np.array([make_va(1, 5)], np.uint64)
    for bad in (v.astype(np.int64), v.astype(">u8"), v.view(np.uint8)):
        with pytest.raises(ValueError, match="uint64"):
            native.segment_stats(bad, np.ones(len(bad), np.uint64) if bad.itemsize == 8 else np.ones(8, np.uint8), OFFSET_BITS)
    with pytest.raises(ValueError, match="equal length"):
        native.segment_stats(v, np.ones(2, np.uint64), OFFSET_BITS)
