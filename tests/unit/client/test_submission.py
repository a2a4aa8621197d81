"""The client's submission state (transfer/client/_submission.py, native/submission.h).

The native `submit` makes, routes and pushes one plain request in one call; everywhere
else, and always with the pure-Python twin, the general path (`prepare`, then `_send`)
does it. The property here: any sequence of submissions, batches, deferred allocations
and frees, socket requests and their answers, completions and a failed session gives the
same ids, errors, descriptors, socket frames, tables and counts either way.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import Phase, event, example, given, settings
from hypothesis import strategies as st

from transfer import errors as E
from transfer import protocol as P
from oracles.submission import PySubmission
from transfer import _native
from transfer.ring import MAX_CHAIN, Ring
from transfer._pending import AwaitablePending, Pending
from transfer.ring import RingLink
from transfer.client._session import Session
Submission = _native.Submission
from transfer.client._sync import Client

pytestmark = pytest.mark.skipif(Submission is PySubmission, reason="extension not built")

_SEG = 1 << 40  # a segment id's VA step (OFFSET_BITS)
#: Field values: in range, at the edges, out of range, and of the wrong type.
_good = st.integers(0, 3 * _SEG)
_odd = st.one_of(_good, st.sampled_from([0, 2**32 - 1, 2**32, 2**64 - 1, 2**64, -1, 255, 256]),
                 st.sampled_from([np.uint64(7), True, 1.0]))
_op = st.one_of(
    st.tuples(st.just("copy"), _good, _good, _good, st.integers(0, 3)),
    st.tuples(st.just("copy"), _odd, _odd, _odd, _odd),
    st.tuples(st.just("fill"), _good, _good, st.integers(0, 255), st.integers(0, 3)),
    st.tuples(st.just("fill"), _odd, _odd, _odd, _odd),
    st.tuples(st.just("checksum"), _odd, _odd, _odd),
    # copy_many and checksum_many: ranges (dst, src, nbytes), a stream, verified or not
    st.tuples(st.just("copy_many"), st.lists(st.tuples(_good, _good, _good), max_size=6), st.integers(0, 3), st.booleans(),
              st.booleans()),
    st.tuples(st.just("checksum_many"), st.lists(st.tuples(_good, _good), min_size=1, max_size=6), st.sampled_from([0, 2**32])),
    st.tuples(st.sampled_from(["deferred", "deferred_many"]), st.integers(0, 2)),  # a copy (copy_many) touching a deferred buffer
    st.tuples(st.sampled_from(["alloc", "free", "socket", "answer", "open", "close", "fence", "break"])),
    st.tuples(st.just("serve"), st.integers(1, 8)),
)


class _Socket:
    """Where the client's socket frames go: kept, to compare."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, frame: bytes, flags: int = 0, copy: bool = True) -> None:
        self.frames.append(bytes(frame))


def _client(native: bool, ring: Ring, after: bool) -> Client:
    """A blocking client with no daemon: its socket keeps frames, its ring is `ring`'s client end."""
    c = object.__new__(Client)
    Session.__init__(c, "ipc:///nowhere", Pending, c._wait_for)  # (the core, the lock, and what they share)
    core = c._core
    if not native:
        core.sub = PySubmission(core.pending, Pending, c._wait_for)
        core.submit = core.sub.submit
    core.on_hello(P.result(P.Hello, {
        "session": 1, "server_pid": 1, "version": P.VERSION, "limits": P.Limits().to_wire(), "max_inflight": 1 << 16,
        "backend": {}, "devices": [], "heartbeat_s": 0.5, "session_timeout_s": 2.0, "shm_dir": "/dev/shm",
        "fd_socket": "/dev/shm/fds", "home_device": 0, "arenas": [{"device": 0, "first_id": 1, "count": 3, "quota": 0}],
    }), True)
    opened = {"token": bytes(16), "bell": bytes(16), "cbell": None, "capacity": ring.request_capacity,
              "completion_capacity": ring.completion_capacity, "after": after}
    core.ring = RingLink(ring, P.result(P.OpenRing, opened), core.sub)
    c._sock = _Socket()
    c._last_tx = 0.0
    return c


def _answers(a: Any) -> Any:
    """An outstanding entry's answers, comparable across runs (a gathered answer by its state)."""
    return a if type(a) is bool else ("sums", a.chain, list(a.values), a.status)


def _run(native: bool, ops: list[tuple[Any, ...]], after: bool, capacity: int) -> list[Any]:
    """What each op did, and the state after it."""
    out: list[Any] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        srv = Ring.create(Path(d) / "r", capacity, capacity)
        cli = Ring.attach(Path(d) / "r")
        try:
            c = _client(native, cli, after)
            core, link = c._core, c._core.ring
            assert link is not None
            bufs: list[Any] = []
            batches: list[Any] = []
            socket_ids: list[int] = []

            def serve(n: int) -> list[bytes]:
                descs = srv.pop_many(n)
                for rid in descs["id"].tolist():
                    srv.push((rid, 0, rid & 0xFF, 0, 0))
                core.reap_ring()
                return [d.tobytes() for d in descs]

            waited: list[Any] = []
            c._wait_room = lambda need: waited.append(serve(capacity))  # type: ignore[method-assign]
            for op in ops:
                kind, *a = op
                try:
                    if kind == "serve":
                        got: Any = serve(a[0])
                    elif link.room < 8 and kind in ("copy", "fill", "checksum", "deferred", "deferred_many", "fence", "copy_many", "checksum_many"):
                        got = ("full", serve(capacity))  # (the general path would wait for credits)
                    else:
                        got = None
                    if kind == "copy":
                        got = c.copy(*a[:3], stream=a[3])
                    elif kind == "fill":
                        got = c.fill(*a[:3], stream=a[3])
                    elif kind == "checksum":
                        got = c.checksum(*a[:2], stream=a[2])
                    elif kind == "copy_many":  # (strided arrays too: every other element of a longer one)
                        ranges, stream, verified, strided = a
                        cols = [np.array([r[i] for r in ranges for _ in range(1 + strided)], np.uint64)[::1 + strided] for i in range(3)]
                        got = c.copy_many(*cols, stream=stream, checksum=verified)
                    elif kind == "checksum_many":
                        ranges, stream = a
                        got = c.checksum_many([r[0] for r in ranges], [r[1] for r in ranges], stream=stream)
                    elif kind == "deferred" and bufs:
                        b = bufs[a[0] % len(bufs)]
                        got = c.copy(b.va, b.va + 64, 64)
                    elif kind == "deferred_many" and bufs:
                        b = bufs[a[0] % len(bufs)]
                        got = c.copy_many([7 << 40, b.va], [7 << 40, b.va + 64], [8, 64])
                    elif kind == "alloc":
                        b = core.deferred.alloc(4096, -1, "test")  # type: ignore[union-attr]
                        bufs.append(b)
                        got = b.va
                    elif kind == "free" and bufs:
                        b = bufs.pop(0)
                        b.defined = True  # (as if a request had defined it: its free travels)
                        core.deferred.free(b)  # type: ignore[union-attr]
                    elif kind == "socket":
                        p = c._submit(P.Stats)
                        socket_ids.append(p.id)
                        got = p.id
                    elif kind == "answer" and socket_ids:
                        p = core.pending.pop(socket_ids.pop(0), None)
                        if p is not None:
                            p._finish({}, None)
                    elif kind == "open":
                        batches.append(c.batch())
                        batches[-1].__enter__()
                    elif kind == "close" and batches:
                        batches.pop().__exit__(None, None, None)
                    elif kind == "fence":  # a Wait marker: the general path, whatever comes next
                        reqs, p = core.prepare(P.Fence, (0,), (), True)
                        c._send(reqs)
                        got = p.id
                    elif kind == "break":
                        core.fail_all(E.SessionClosed("gone"))
                    if isinstance(got, Pending):
                        got = (type(got).__name__, got.id, got._done)
                except (E.TransferError, TypeError, ValueError) as exc:
                    got = (type(exc).__name__, str(exc))
                out.append((op, got, sorted(core.pending), {k: (_answers(v[1]), v[2]) for k, v in link.outstanding.items()},
                            core.sub.next_id, core.sub.frames, core.sub.fenced, core.sub.pushed, core.sub.in_flight,
                            core.sub.batching, core.sub.broken, list(c._sock.frames), list(waited)))
            while batches:
                batches.pop().__exit__(None, None, None)
            out.append(("end", serve(capacity), sorted(core.pending), list(c._sock.frames)))
        finally:
            cli.close()
            srv.close()
    return out


@example([("socket",), ("copy", 1, 2, 3, 0), ("copy", 4, 5, 6, 0), ("socket",), ("fill", 1, 2, 3, 0)], True, 64)  # fences
@example([("alloc",), ("deferred_many", 0), ("deferred", 0)], False, 64)  # definitions go first
@settings(max_examples=150, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
@given(st.lists(_op, max_size=30), st.booleans(), st.sampled_from([2, 4, 64]))
def test_native_submit_is_the_general_path(ops: list[tuple[Any, ...]], after: bool, capacity: int) -> None:
    """The native submit and the twin (which leaves every request to the general path) give
    the same ids, errors, descriptors, socket frames, tables and counts."""
    native = _run(True, ops, after, capacity)
    python = _run(False, ops, after, capacity)
    assert native == python
    event(f"ring descriptors: {'some' if native[-1][1] or any(o[0][0] == 'serve' and o[1] for o in native[:-1]) else 'none'}")


def test_native_submit_takes_a_plain_copy_and_declines_the_rest() -> None:
    """What `submit` takes itself: a plain request with exact ints, nothing else due. What it
    leaves to the general path: another kind, a field to convert or refuse, a batch, a
    deferred buffer's definition, frees to send, a held request, the socket's turn."""
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        srv = Ring.create(Path(d) / "r", 8, 8)
        cli = Ring.attach(Path(d) / "r")
        try:
            c = _client(True, cli, after=False)
            core = c._core
            assert core.sub.templated  # (a Pending is made without a Python frame)
            p = core.submit(P.Copy, (1 << 41, 1 << 41, 8, 0))
            assert isinstance(p, Pending) and p.id == 1 and core.pending[1] is p and core.sub.in_flight == 1
            made = Pending(1, c._wait_for)  # what the class makes: the same fields
            assert [getattr(p, f) for f in Pending.__slots__] == [getattr(made, f) for f in Pending.__slots__]
            held, done = threading.Event(), threading.Event()

            def hold() -> None:
                with c._lock:
                    held.set()
                    done.wait(10)

            t = threading.Thread(target=hold)  # another thread holds the client's lock: submit leaves the
            t.start()  # request to the general path, which waits for it
            held.wait(10)
            assert core.submit(P.Copy, (1 << 41, 1 << 41, 8, 0)) is None and core.sub.next_id == 2
            done.set()
            t.join(10)
            assert c._lock.acquire(blocking=False)  # (and submit left it as it found it)
            c._lock.release()
            assert srv.pop_many(8)["id"].tolist() == [1]
            for cls, args in [(P.Copy, (1, 2, np.uint64(3), 0)), (P.Copy, (1, 2, 3, 2**32)), (P.Fill, (1, 2, 256, 0)),
                              (P.Copy, (1, 2, -1, 0)), (P.Copy, (1, 2, True, 0)), (P.Copy, (1, 2, 3)), (P.Fence, (0,)),
                              (P.Stats, ())]:
                assert core.submit(cls, args) is None, (cls, args)
            buf = core.deferred.alloc(64, -1, "here")  # type: ignore[union-attr]
            assert core.submit(P.Copy, (buf.va, 1 << 41, 8, 0)) is None  # its definition goes first
            assert core.submit(P.Checksum, (buf.va, 8, 0)) is None
            assert core.submit(P.Copy, (7 << 40, 7 << 40, 8, 0)) is not None  # (another segment)
            held: list[int] = []
            core.hold_while(held)
            held.append(1)
            assert core.submit(P.Copy, (7 << 40, 7 << 40, 8, 0)) is None
            held.clear()
            with c.batch():
                assert core.submit(P.Copy, (7 << 40, 7 << 40, 8, 0)) is None
            c._submit(P.Stats)  # a socket request pending, and a daemon that cannot order after it
            assert core.submit(P.Copy, (7 << 40, 7 << 40, 8, 0)) is None
            assert core.sub.next_id == 4 and core.sub.in_flight == 2  # (the Stats took id 3)
            # Vectors: taken when each operand is a 1-D uint64 array of one length, within the
            # chain and the credits left (here 8 - 2), and no deferred buffer awaits its definition.
            u = np.arange(3, dtype=np.uint64) + np.uint64(7 << 40)
            core.deferred.buffers.clear()  # type: ignore[union-attr]
            for cls, args in [(P.CopyV, (u, u, u[:2], 0)), (P.CopyV, (u, u, u.astype(np.int64), 0)), (P.CopyV, (u, 1, u, 0)),
                              (P.CopyV, (u, u, u, 0, 1)), (P.CopyV, (u[:0], u[:0], u[:0], 0)), (P.ChecksumV, (u, u, 2**32)),
                              (P.CopyV, (*[np.arange(7, dtype=np.uint64)] * 3, 0))]:
                assert core.submit(cls, args) is None, (cls, args)
            core.pending.pop(3)  # (the Stats: answered)
            v = core.submit(P.CopyV, (u, u, u, 0, True))
            assert v is not None and core.ring.outstanding[v.id][2] == 3 and core.sub.in_flight == 5  # type: ignore[union-attr]
            descs = srv.pop_many(16)
            assert (descs["flags"][-3:] & 0x5).tolist() == [5, 5, 4]  # (FLAG_CHAIN | FLAG_SUM; the last FLAG_SUM)
            # The longest copy_many a ring carries is the daemon's chain (MAX_CHAIN), below its credits on a large ring.
            srv2 = Ring.create(Path(d) / "big", 8192, 8192)
            cli2 = Ring.attach(Path(d) / "big")
            try:
                c2 = _client(True, cli2, after=False)
                longest = c2._core.ring.max_chain  # type: ignore[union-attr]
                assert longest == MAX_CHAIN < 8192
                big = np.arange(longest + 1, dtype=np.uint64)
                assert c2._core.submit(P.CopyV, (big, big, big, 0)) is None
                assert c2._core.submit(P.CopyV, (big[:-1], big[:-1], big[:-1], 0)) is not None
            finally:
                cli2.close()
                srv2.close()
            for cls in (Pending, AwaitablePending):
                assert PySubmission({}, cls, print).templated is False and Submission({}, cls, print).templated
        finally:
            cli.close()
            srv.close()
