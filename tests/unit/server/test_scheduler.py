"""The batcher's equivalence with sequential execution (hypothesis), and its parts."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _world import BACKENDS, SIZES, close_cpu_backends, contents, load, make_world, va
from transfer import errors as E
from transfer._checksum import checksum64
from transfer import protocol as P
from transfer.kernels import TensorRef
from transfer.server._ops import SOCKET
from transfer.server._batch import plan_batch
from transfer.server._planner import Planner
from transfer.server._remotepost import loop_posts as _loop_posts
from transfer.server._waves import _Intervals, assign_waves, coalesce, run_waves

@pytest.fixture(scope="module", autouse=True)
def _close_cpu_backends() -> Iterator[None]:
    yield
    close_cpu_backends()


@st.composite
def a_range(draw: st.DrawFn, max_len: int = 1500) -> tuple[int, int, int]:
    seg = draw(st.integers(0, len(SIZES) - 1))
    n = draw(st.integers(0, min(max_len, SIZES[seg])))
    off = draw(st.integers(0, SIZES[seg] - n))
    return seg, off, n


@st.composite
def request(draw: st.DrawFn, rid: int) -> P.Request:
    kind = draw(st.sampled_from(["copy"] * 6 + ["fill", "copyv", "mixed", "scale_add", "checksum", "bad"]))
    if kind == "copy":
        ds, do, n = draw(a_range())
        ss = draw(st.integers(0, len(SIZES) - 1))
        so = draw(st.integers(0, SIZES[ss] - n)) if SIZES[ss] >= n else 0
        if SIZES[ss] < n:
            n = SIZES[ss]
            do = min(do, SIZES[ds] - n)
        return P.Copy(rid, va(ds, do), va(ss, so), n)
    if kind == "fill":
        s, o, n = draw(a_range())
        return P.Fill(rid, va(s, o), n, draw(st.integers(0, 255)))
    if kind == "copyv":
        k = draw(st.integers(1, 6))
        s = draw(st.integers(0, len(SIZES) - 1))
        d = draw(st.integers(0, len(SIZES) - 1))
        piece = draw(st.integers(1, 256))
        dst = [va(d, draw(st.integers(0, SIZES[d] - piece))) for _ in range(k)]
        if draw(st.booleans()):  # sometimes contiguous runs (the merging path)
            start = draw(st.integers(0, SIZES[s] - piece * k))
            src = [va(s, start + i * piece) for i in range(k)]
            dstart = draw(st.integers(0, SIZES[d] - piece * k))
            dst = [va(d, dstart + i * piece) for i in range(k)]
        else:
            src = [va(s, draw(st.integers(0, SIZES[s] - piece))) for _ in range(k)]
        return P.CopyV(rid, np.array(dst, np.uint64), np.array(src, np.uint64), np.full(k, piece, np.uint64))
    if kind == "mixed":
        # Pieces between any segments, often chained (a piece reads what an earlier one wrote):
        # host and device pieces of one request must still take effect in order.
        k = draw(st.integers(2, 10))
        dst, src, size = [], [], []
        for _ in range(k):
            n = draw(st.integers(1, 200))
            if dst and draw(st.booleans()):
                src.append(dst[-1])
                n = min(n, size[-1])
            else:
                ss = draw(st.integers(0, len(SIZES) - 1))
                src.append(va(ss, draw(st.integers(0, SIZES[ss] - n))))
            ds = draw(st.integers(0, len(SIZES) - 1))
            dst.append(va(ds, draw(st.integers(0, SIZES[ds] - n))))
            size.append(n)
        return P.CopyV(rid, np.array(dst, np.uint64), np.array(src, np.uint64), np.array(size, np.uint64))
    if kind == "checksum":
        s, o, n = draw(a_range())
        return P.Checksum(rid, va(s, o), n)
    if kind == "scale_add":
        s = draw(st.integers(0, len(SIZES) - 1))
        count = draw(st.integers(1, 64))
        xo = draw(st.integers(0, SIZES[s] - count * 4))  # any offset: a GPU needs aligned operands
        same = draw(st.booleans())
        yo = xo if same else draw(st.integers(0, SIZES[s] - count * 4))
        x = TensorRef(va(s, xo), "float32", (count,))
        y = TensorRef(va(s, yo), "float32", (count,))
        return P.Compute(rid, "scale_add", [x], [y], {"a": 0.5, "b": 1.0})
    # Out of bounds: must fail alone and touch nothing.
    s = draw(st.integers(0, len(SIZES) - 1))
    return P.Copy(rid, va(s, SIZES[s] - 10), va(s, 0), 20)


def reference(mem: list[np.ndarray], reqs: list[P.Request]) -> dict[int, Any]:
    """One request at a time, written independently of the daemon's code: id -> None, checksum or error class."""
    outcome: dict[int, Any] = {}

    def view(v: int, n: int) -> np.ndarray:
        seg, off = (v >> 40) - 1, v & ((1 << 40) - 1)
        if off + n > SIZES[seg]:
            raise E.OutOfBounds
        return mem[seg][off : off + n]

    for r in reqs:
        try:
            if isinstance(r, P.Copy):
                src = view(r.src, r.nbytes).copy()
                view(r.dst, r.nbytes)[:] = src
            elif isinstance(r, P.Fill):
                view(r.dst, r.nbytes)[:] = r.value
            elif isinstance(r, P.Checksum):
                outcome[r.id] = checksum64(view(r.src, r.nbytes))
                continue
            elif isinstance(r, P.CopyV):
                for d, s, n in zip(r.dst.tolist(), r.src.tolist(), r.nbytes.tolist()):
                    view(d, n)[:] = view(s, n).copy()
            elif isinstance(r, P.Compute):
                (x,), (y,) = r.inputs, r.outputs
                n = x.shape[0] * 4
                xs, ys = view(x.va, n), view(y.va, n)
                xv = xs.view(np.float32)
                if x.va != y.va and (abs(x.va - y.va) < n):
                    raise E.InvalidField  # overlapping but not in place: refused
                with np.errstate(all="ignore"):  # random bytes include NaNs
                    out = xv * np.float32(0.5)
                    out += np.float32(1.0)
                ys.view(np.float32)[:] = out
            outcome[r.id] = None
        except E.TransferError as exc:
            outcome[r.id] = type(exc)
    return outcome


async def run_batched(planner: Planner, devices: list, reqs: list[P.Request], inline_bytes: int) -> dict[int, Any]:
    """Exactly the daemon's pass: plan_batch (copy runs as vectors), waves, merged execution."""
    ops, refused = plan_batch(planner, "s", [(r, SOCKET) for r in reqs])
    waves = assign_waves(ops)
    await run_waves(waves, {d.index: trio.CapacityLimiter(1) for d in devices}, inline_bytes)
    out: dict[int, Any] = {rid: type(err) for rid, _, err in refused}
    for op in ops:
        ids = [op.rid] if op.ids is None else [int(i) for i in op.ids]
        if op.error is not None:
            out.update((i, type(op.error)) for i in ids)
        else:
            out.update((i, op.result if op.kind == "checksum" else None) for i in ids)
    return out


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN bytes through scale_add, in the daemon's kernel
def test_loop_posts_cut_a_remote_group_by_bytes() -> None:
    """A remote group fits in one post from the loop, or is cut at op boundaries into posts of
    at most the limit; a group with an op over the limit stays one post (a worker thread's)."""
    ops = [SimpleNamespace(nbytes=n) for n in (400, 300, 500, 900, 100, 600)]
    assert _loop_posts(ops[:2], 1000) == [ops[:2]]
    parts = _loop_posts(ops, 1000)
    assert parts == [ops[0:2], [ops[2]], [ops[3], ops[4]], [ops[5]]]
    assert all(sum(o.nbytes for o in p) <= 1000 for p in parts)
    assert [o for p in parts for o in p] == ops
    big = [*ops[:2], SimpleNamespace(nbytes=2000)]
    assert _loop_posts(big, 1000) == [big]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from([0, 1 << 30]))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_batched_execution_equals_sequential(backend_name: str, data: st.DataObject, inline_bytes: int) -> None:
    batched_equals_sequential(backend_name, data, inline_bytes)


@pytest.mark.slow
@pytest.mark.timeout(600)  # (five times the default's examples: minutes on a loaded machine)
@settings(max_examples=360, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data(), st.sampled_from([0, 1 << 30]))
@pytest.mark.parametrize("backend_name", BACKENDS)
def test_batched_execution_equals_sequential_deep(backend_name: str, data: st.DataObject, inline_bytes: int) -> None:
    """The same property, six times as many examples (`-m slow`)."""
    batched_equals_sequential(backend_name, data, inline_bytes)


def batched_equals_sequential(backend_name: str, data: st.DataObject, inline_bytes: int) -> None:
    """Random requests, run batched (waves, merged copies, vector ops) on the backend, leave the
    memory and the replies that running them one by one in plain Python gives."""
    n = data.draw(st.integers(1, 40))
    reqs = [data.draw(request(i + 1)) for i in range(n)]
    if data.draw(st.booleans()):  # a burst of plain copies: planned as one vector op, pieces in order
        for _ in range(data.draw(st.integers(8, 12))):
            r = data.draw(request(len(reqs) + 1))
            if type(r) is not P.Copy:
                r = P.Copy(len(reqs) + 1, va(0, 0), va(2, 0), 64)
            reqs.append(r)
    planner, devices, mem = make_world(backend_name=backend_name)
    seed = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    for m in mem:
        load(m, seed.integers(0, 256, len(m), dtype=np.uint8))
    ref_mem = [contents(m).copy() for m in mem]
    expected = reference(ref_mem, reqs)
    got = trio.run(run_batched, planner, devices, reqs, inline_bytes)
    assert {k: v for k, v in got.items()} == expected
    for a, b in zip(mem, ref_mem):
        assert np.array_equal(contents(a), b)
    if backend_name == "streamsim":
        backend = devices[0].backend
        assert backend.violations == [] and backend.pending() == 0 and not backend.broken


def test_independent_copies_share_one_wave_and_merge() -> None:
    planner, devices, mem = make_world()
    reqs = [P.Copy(i + 1, va(2, i * 100), va(0, i * 100), 100) for i in range(30)]
    ops = [planner.plan("s", r) for r in reqs]
    waves = assign_waves(ops)
    assert len(waves) == 1
    units = coalesce(waves[0])
    assert len(units) == 1 and len(units[0][0]) == 30  # thirty contiguous copies, one memcpy


def test_hazards_split_waves_in_order() -> None:
    planner, _, _ = make_world()
    reqs = [
        P.Copy(1, va(1, 0), va(0, 0), 100),  # writes seg1[0:100]
        P.Copy(2, va(2, 0), va(1, 50), 100),  # reads seg1[50:150]: read-after-write
        P.Fill(3, va(0, 0), 10, 1),  # writes seg0[0:10] which op1 read: write-after-read
        P.Fill(4, va(2, 500), 10, 1),  # independent of ops 1-3: the first wave
        P.Fill(5, va(2, 505), 10, 2),  # overlaps op 4: write-after-write
        P.Copy(6, va(1, 200), va(2, 0), 10),  # reads seg2[0:10], which op 2 writes
    ]
    waves = assign_waves([planner.plan("s", r) for r in reqs])
    assert [[o.rid for o in w] for w in waves] == [[1, 4], [2, 3, 5], [6]]


_RANGES = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 60), st.integers(0, 12)).map(lambda t: (t[0], t[1], t[1] + t[2])), max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_RANGES, _RANGES), max_size=60))
def test_waves_keep_every_conflict_in_order(spec: list[tuple[list[Any], list[Any]]]) -> None:
    """Whatever the ops: each runs in a later wave than every earlier op it conflicts with
    (RAW, WAR, WAW), nothing in a wave conflicts, and every op is placed once. Long chains
    of conflicts (up to 60 waves) pass the lookback bound."""
    ops = [SimpleNamespace(rid=i, reads=r, writes=w) for i, (r, w) in enumerate(spec)]

    def hit(x: list[Any], y: list[Any]) -> bool:
        return any(s1 == s2 and a1 < b2 and a2 < b1 and a1 < b1 and a2 < b2 for s1, a1, b1 in x for s2, a2, b2 in y)  # empty: none

    def conflict(p: Any, q: Any) -> bool:
        return hit(p.writes, q.reads) or hit(p.reads, q.writes) or hit(p.writes, q.writes)

    waves = assign_waves(ops)  # type: ignore[arg-type]
    where = {op.rid: k for k, wave in enumerate(waves) for op in wave}
    assert sorted(where) == list(range(len(ops))) and sum(map(len, waves)) == len(ops)
    assert all(waves)
    for j, q in enumerate(ops):
        for p in ops[:j]:
            if conflict(p, q):
                assert where[p.rid] < where[q.rid], (p, q, waves)


def test_an_op_past_the_lookback_still_follows_what_it_conflicts_with() -> None:
    """A chain of 12 waves, then ops that conflict only with its first waves: placed after
    them (the lookback bounds where an op may go, not what it is checked against)."""
    chain = [SimpleNamespace(rid=i, reads=[(1, (i - 1) * 10, i * 10)] if i else [], writes=[(1, i * 10, i * 10 + 10)]) for i in range(12)]
    late_read = SimpleNamespace(rid=100, reads=[(1, 0, 10)], writes=[])  # reads what op 0 wrote
    late_write = SimpleNamespace(rid=101, reads=[], writes=[(1, 0, 10)])  # op 1 read it: after wave 1
    free = SimpleNamespace(rid=102, reads=[(2, 0, 10)], writes=[(2, 20, 30)])
    waves = assign_waves([*chain, late_read, late_write, free])  # type: ignore[arg-type]
    where = {op.rid: k for k, wave in enumerate(waves) for op in wave}
    assert [where[i] for i in range(12)] == list(range(12))
    assert where[100] >= 1 and where[101] >= 2 and where[102] >= 0
    assert where[101] != where[100]


def test_a_read_then_its_sums_make_two_waves_for_many_groups() -> None:
    """A verified group is a copy, then an op reading what it wrote: n groups in one pass are
    two waves (the copies together, then the sums), not two per group."""
    ops = []
    for g in range(6):
        ops.append(SimpleNamespace(rid=2 * g, reads=[(0, g * 100, g * 100 + 100)], writes=[(1, g * 100, g * 100 + 100)]))
        ops.append(SimpleNamespace(rid=2 * g + 1, reads=[(1, g * 100, g * 100 + 100)], writes=[]))
    waves = assign_waves(ops)  # type: ignore[arg-type]
    assert [[o.rid for o in w] for w in waves] == [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 50)), max_size=30), st.integers(0, 250), st.integers(0, 60))
def test_interval_union(adds: list[tuple[int, int]], a: int, n: int) -> None:
    iv, cover = _Intervals(), np.zeros(400, bool)
    for s, ln in adds:
        iv.add(s, s + ln)
        cover[s : s + ln] = True
    assert iv.overlaps(a, a + n) == bool(cover[a : a + n].any())
    assert all(e1 < s2 for e1, s2 in zip(iv.ends, iv.starts[1:]))  # disjoint, non-touching


def test_placement_rule_and_policies() -> None:
    planner, devices, _ = make_world()
    x = TensorRef(va(0, 0), "float32", (4,))
    y = TensorRef(va(0, 64), "float32", (4,))
    placed = {planner.plan("s", P.Compute(i + 1, "scale_add", [x], [y], {})).device.index for i in range(4)}
    assert placed == {0, 1}  # round-robin over host-only operands
    on_dev = TensorRef(va(2, 0), "float32", (4,))
    assert planner.plan("s", P.Compute(9, "scale_add", [on_dev], [on_dev], {})).device.index == 0
    with pytest.raises(E.InvalidField, match="pins device 1"):
        planner.plan("s", P.Compute(10, "scale_add", [on_dev], [on_dev], {}, device=1))
    with pytest.raises(E.InvalidField, match="supported dtypes"):
        planner.plan("s", P.Compute(11, "matmul", [TensorRef(va(0, 0), "int8", (2, 2))] * 2, [TensorRef(va(0, 64), "int8", (2, 2))], {}))
    with pytest.raises(E.InvalidField, match="overlaps"):
        planner.plan("s", P.Compute(12, "cast", [TensorRef(va(0, 0), "uint8", (8,))], [TensorRef(va(0, 4), "float32", (8,))], {}))
