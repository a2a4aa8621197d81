"""Fuzzing a live transferd over a raw zmq DEALER.

1. Frame fuzzer: random bytes, valid frames with mutated bytes, valid msgpack
   of the wrong shapes/types (huge ints, deep nesting), hand-made pathological
   frames and multi-part messages. Every frame must be answered with exactly
   the replies its requests call for (a frame that cannot be decoded: one
   reply with id 0 and the protocol error's code); the daemon must stay up; a
   normal client must keep working and its memory must be untouched; nothing
   may leak (segments in the daemon, files in the shm dir).
2. A stateful test (hypothesis RuleBasedStateMachine) of one session against
   a plain-Python model of its memory: the daemon's bytes, checksums and
   error classes must equal the model's.

Run with ``-s`` to see the counts (frames sent, replies, distinct codes). Each property
runs at two depths: the default suite's, and a deep run under ``-m slow`` (CI runs both);
``FUZZ_EXAMPLES`` / ``FUZZ_MACHINES`` set the number of examples / machines of every run.
"""

from __future__ import annotations

import collections
import itertools
import os
import time
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

import transfer
from conftest import segment_files, wait_for
from transfer import errors as E
from transfer import protocol as P
from transfer.addressing import MAX_SEGMENT_ID, OFFSET_BITS
from transfer.memory import ShmFile
from transfer.transport._fds import fetch_fd

# Quotas keep a fuzzed RegisterHost/Alloc from eating the machine's memory. The
# daemon fixture inherits the environment, so these reach transferd via TRANSFER_*.
FUZZ_ENV = {
    "TRANSFER_MAX_HOST_BYTES_PER_SESSION": "4MiB",
    "TRANSFER_MAX_DEVICE_BYTES_PER_SESSION": "4MiB",
    "TRANSFER_MAX_DEVICE_BYTES": "64MiB",
    "TRANSFER_MAX_SEGMENTS_PER_SESSION": "64",
}
REPLY_LIMITS = P.Limits(max_frame_bytes=1 << 30, max_bin=1 << 30, max_str=1 << 20)
SENTINEL = (1 << 64) - 1  # request id of the Fence that ends each exchange
STATS: dict[str, Any] = {"frames": 0, "replies": 0, "codes": collections.Counter(), "crashes": 0}


@pytest.fixture
def fuzz_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in FUZZ_ENV.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def fuzzd(fuzz_env: None, daemon):  # fuzz_env first: the daemon starts with the quotas
    return daemon


@pytest.fixture(scope="module", autouse=True)
def report() -> Any:
    yield
    codes = dict(sorted(STATS["codes"].items()))
    print(
        f"\nfuzz: {STATS['frames']} frames sent, {STATS['replies']} replies, "
        f"{len(codes)} distinct codes {codes}, {STATS['crashes']} daemon crashes"
    )


class Raw:
    """A raw DEALER: send frames, collect replies up to a sentinel Fence."""

    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.ids = itertools.count(1)

    def close(self) -> None:
        self.sock.close(0)

    def recv(self, timeout: float = 5.0) -> list[P.Reply]:
        if not self.sock.poll(int(timeout * 1000)):  # a lost reply fails here, not at the test timeout
            raise AssertionError(f"no reply within {timeout}s")
        parts = self.sock.recv_multipart()
        assert len(parts) == 1, f"daemon sent a {len(parts)}-part reply"
        replies = P.decode_replies(parts[0], REPLY_LIMITS)  # the daemon's replies are always well formed
        return replies

    def exchange(self, parts: list[bytes], expect: list[int] | None = None, fence: bool = True) -> list[P.Reply]:
        """Send one message (maybe multi-part), then a Fence; return every reply but the Fence's.

        Waits for the Fence's reply and for every id in `expect` (a reply may legally be
        overtaken, e.g. by SessionClosed for the Fence once a Close has run). Without
        `fence`, waits for `expect` alone: the daemon drops frames queued behind a Close
        without replying (see test_requests_queued_behind_close_are_answered).
        """
        STATS["frames"] += 1
        self.sock.send_multipart(parts)
        if fence:
            self.sock.send(P.encode_requests([P.Fence(SENTINEL)]))
        want = collections.Counter(expect or [])
        got: list[P.Reply] = []
        fenced = not fence
        while not fenced or want - collections.Counter(r.id for r in got):
            for r in self.recv():
                if r.id == SENTINEL and not fenced:
                    fenced = True
                else:
                    got.append(r)
        while not fence and self.sock.poll(20):  # replies beyond `expect` (after a Close)
            got.extend(self.recv())
        STATS["replies"] += len(got)
        for g in got:
            STATS["codes"][g.error.code if g.error else 0] += 1
        return got

    def call(self, req: P.Request) -> P.Reply:
        (r,) = self.exchange([P.encode_requests([req])], [req.id], fence=not isinstance(req, P.Close))
        assert r.id == req.id
        return r

    def hello(self, pid: int = 0) -> dict[str, Any]:
        r = self.call(P.Hello(next(self.ids), P.VERSION, "fuzz", pid, b""))
        assert r.error is None, r.error
        return r.result


def expected_ids(parts: list[bytes]) -> tuple[list[int], list[int], int | None]:
    """What the daemon must answer: (all reply ids, the ids it must answer at least, a
    frame-level code if any). They differ only for a frame holding a Close: requests
    after it go unanswered (a daemon bug, test_requests_queued_behind_close_are_answered)."""
    if len(parts) != 1:
        return [0], [0], E.MalformedFrame.code
    try:
        reqs = P.decode_requests(parts[0], P.DEFAULT_LIMITS)
    except E.ProtocolError as exc:
        return [0], [0], exc.code
    ids = [r.id for r in reqs]
    for i, r in enumerate(reqs):
        if isinstance(r, P.Close):
            return ids, ids[: i + 1], None
    return ids, ids, None


def check_exchange(raw: Raw, parts: list[bytes]) -> list[P.Reply]:
    ids, must, frame_code = expected_ids(parts)
    closes = must != ids or any(isinstance(r, P.Close) for r in _decoded(parts))
    replies = raw.exchange(parts, must, fence=not closes)
    got = collections.Counter(r.id for r in replies)
    assert not collections.Counter(must) - got and not got - collections.Counter(ids), (parts, replies)
    if frame_code is not None:
        assert replies[0].error is not None and replies[0].error.code == frame_code, replies
    for r in replies:
        if r.error is not None:
            assert r.error.code not in (E.InternalError.code, E.TransferError.code), r.error
    return replies


def _decoded(parts: list[bytes]) -> list[P.Decoded]:
    try:
        return P.decode_requests(parts[0], P.DEFAULT_LIMITS) if len(parts) == 1 else []
    except E.ProtocolError:
        return []


# --- strategies ---------------------------------------------------------------------------
u64s = st.one_of(st.integers(0, 16), st.integers(0, (1 << 64) - 1), st.sampled_from([(1 << 64) - 1, 1 << 63, 1 << 40, (1 << 40) - 1, MAX_SEGMENT_ID << OFFSET_BITS]))
leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=24),
)
shapes = st.recursive(leaves, lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=4), kids, max_size=3), max_leaves=20)

PATHOLOGICAL = [
    b"",
    b"\xc1",  # never-used msgpack byte
    b"\x91" * 100_000 + b"\xc0",  # 100k nested arrays
    b"\x92\x01" + b"\x91" * 2000 + b"\xc0",
    b"\xdd\xff\xff\xff\xff",  # array32 claiming 4G elements
    b"\xdf\xff\xff\xff\xff",  # map32 claiming 4G pairs
    b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
    b"\xdb\x7f\xff\xff\xff" + b"a" * 10,  # str32 claiming 2 GiB
    msgpack.packb([1, [[3, 1]]])[:-1],
    msgpack.packb([1, [[20, 1, 0, 0, 0, 0]] * 70_000]),  # above max_batch
    msgpack.packb([1, [[21, 1, b"\0" * 8 * 70_000, b"\0" * 8 * 70_000, b"\0" * 8 * 70_000, 0]]]),  # above max_vector
    msgpack.packb([1, [[21, 1, b"\0" * 9, b"\0" * 8, b"\0" * 8, 0]]]),
    msgpack.packb([1, [[1, 1, 1, "x" * 5000, 0, b""]]]),
    b"\xd4\x01\x00",  # ext type
    msgpack.packb([1, msgpack.ExtType(1, b"x")]),
    msgpack.packb([1, []]),  # no requests: nothing to answer
    msgpack.packb([2, [[3, 1]]]),
    msgpack.packb([True, [[3, 1]]]),
    msgpack.packb({"a": 1}),
    msgpack.packb([1, [[3, 0], [3, -1], [3, 1 << 64 - 1], [3, 1.0], [3, True]]]),
    b"\x00" * ((4 << 20) + 1),  # above max_frame_bytes
]


def request_strategy(vas: list[int]) -> st.SearchStrategy[list[Any]]:
    va = st.one_of(st.sampled_from(vas), st.sampled_from(vas).map(lambda v: v + 8), u64s) if vas else u64s
    small = st.one_of(st.integers(0, 70_000), u64s)
    vec = st.lists(st.one_of(st.sampled_from(vas), u64s) if vas else u64s, max_size=8).map(lambda xs: np.asarray(xs, dtype="<u8").tobytes())
    rid = st.integers(1, (1 << 64) - 2)
    return st.one_of(
        st.tuples(st.just(20), rid, va, va, small, st.integers(0, 3)),
        st.tuples(st.just(22), rid, va, small, st.integers(0, 255), st.just(0)),
        st.tuples(st.just(23), rid, va, small, st.just(0)),
        st.tuples(st.just(21), rid, vec, vec, vec, st.just(0)),
        st.tuples(st.just(10), rid, st.integers(0, 1 << 20) | u64s),
        st.tuples(st.just(12), rid, st.integers(0, 1 << 20) | u64s, st.integers(-2, 3)),
        st.tuples(st.sampled_from([11, 13]), rid, va),
        st.tuples(st.sampled_from([2, 3, 30, 40]), rid),
        st.tuples(st.just(1), rid, st.integers(0, 3), st.text(max_size=8), st.just(0), st.binary(max_size=8)),
    ).map(list)


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    buf = bytearray(data)
    for kind, pos, val in edits:
        if not buf:
            break
        i = pos % len(buf)
        if kind == 0:
            buf[i] = val
        elif kind == 1:
            del buf[i:]
        elif kind == 2:
            buf.insert(i, val)
        else:
            buf[i:i] = buf[i : i + 1 + val % 16]
    return bytes(buf)


@st.composite
def frames(draw: st.DrawFn, vas: list[int]) -> list[bytes]:
    kind = draw(st.sampled_from(["bytes", "mutated", "shape", "wrong-fields", "valid", "multipart", "pathological"]))
    if kind == "bytes":
        return [draw(st.binary(max_size=300))]
    reqs = draw(st.lists(request_strategy(vas), min_size=1, max_size=6))
    valid = msgpack.packb([P.VERSION, reqs], use_bin_type=True)
    if kind == "valid":
        return [valid]
    if kind == "mutated":
        edits = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4))
        return [mutate(valid, edits)]
    if kind == "shape":
        top = draw(st.one_of(shapes, st.tuples(st.just(P.VERSION), shapes).map(list)))
        return [msgpack.packb(top, use_bin_type=draw(st.booleans()))]
    if kind == "wrong-fields":
        items = draw(st.lists(st.tuples(st.sampled_from(sorted(P.REQUEST_TYPES)) | st.integers(-5, 300), st.integers(-1, 1 << 64 - 1) | st.integers(1, 50)).flatmap(
            lambda h: st.lists(leaves, max_size=7).map(lambda fs: [h[0], h[1], *fs])
        ), max_size=5))
        return [msgpack.packb([P.VERSION, items], use_bin_type=True)]
    if kind == "multipart":
        n = draw(st.integers(2, 4))
        return [valid] + [draw(st.binary(max_size=16)) for _ in range(n - 1)]
    return [draw(st.sampled_from(PATHOLOGICAL))]


#: Examples per property: the default suite's, and the deep run's (`-m slow`).
DEPTHS = pytest.mark.parametrize("depth", [pytest.param(1, id="default"), pytest.param(6, id="deep", marks=[pytest.mark.slow, pytest.mark.timeout(600)])])


def examples(depth: int, per_depth: int = 60, env: str = "FUZZ_EXAMPLES") -> int:
    return int(os.environ.get(env, per_depth * depth))


# --- the frame fuzzer ---------------------------------------------------------------------
@DEPTHS
def test_frame_fuzzer(fuzzd, shm_dir: Path, depth: int) -> None:
    victim = transfer.connect(fuzzd.endpoint, name="victim")
    vseg = victim.segment(1 << 16)
    vseg.buffer[:] = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)[: 1 << 16]
    vbuf = victim.alloc(1 << 16)
    victim.copy(vbuf, vseg).result()
    want = transfer.checksum64(vseg.buffer)

    # No shrink phase: each failing try can wait seconds for a reply that never comes, and
    # shrinking would take minutes; the failing example is printed unshrunk.
    @settings(
        max_examples=examples(depth),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=[Phase.explicit, Phase.generate],
    )
    @given(data=st.data(), with_session=st.booleans())
    def run(data: st.DataObject, with_session: bool) -> None:
        raw = Raw(fuzzd.endpoint)
        try:
            vas = [vseg.va, vbuf.va, 0]
            if with_session:
                raw.hello(pid=os.getpid())
                seg = raw.call(P.RegisterHost(next(raw.ids), 1 << 16))
                buf = raw.call(P.Alloc(next(raw.ids), 1 << 16, -1))
                assert seg.error is None and buf.error is None, (seg, buf)
                vas += [seg.result["va"], buf.result["va"]]
            for parts in data.draw(st.lists(frames(vas), min_size=1, max_size=4)):
                check_exchange(raw, parts)
                if not fuzzd.alive():
                    STATS["crashes"] += 1
                    pytest.fail(f"daemon died on {parts!r:.300}")
            raw.call(P.Close(next(raw.ids)))
        finally:
            raw.close()

    try:
        run()
        assert fuzzd.alive()
        # A normal client still works, and its memory was never touched.
        assert victim.checksum(vseg).result() == want
        assert victim.checksum(vbuf).result() == want
        with transfer.connect(fuzzd.endpoint) as c:
            b = c.alloc(4096)
            c.fill(b, 4096, 7).result()
            assert c.checksum(b).result() == transfer.checksum64(b"\x07" * 4096)
    finally:
        victim.close()
    # Every fuzz session was closed: nothing is left, in the daemon or on disk, while it still runs.
    with transfer.connect(fuzzd.endpoint) as c:
        wait_for(lambda: c.stats()["daemon"]["segments"] == 0 and c.stats()["daemon"]["sessions"] == 1, "fuzz sessions to be released")
        assert c.stats()["daemon"]["device_bytes"] == 0
    assert segment_files(shm_dir) == []


def test_pathological_frames_one_by_one(fuzzd) -> None:
    """Each hand-made frame, with and without a session; the empty request list is the one frame
    the daemon does not answer (there is no request to reply to)."""
    for with_session in (False, True):
        raw = Raw(fuzzd.endpoint)
        try:
            if with_session:
                raw.hello()
            for frame in PATHOLOGICAL:
                check_exchange(raw, [frame])
                assert fuzzd.alive()
            check_exchange(raw, [b"a", b"b", b"c"])
        finally:
            raw.close()
    with transfer.connect(fuzzd.endpoint) as c:
        c.fence()


def test_requests_queued_behind_close_are_answered(fuzzd) -> None:
    """Close, then a Fence sent before the Close has run: the Fence must still be answered
    (SessionClosed), or a pipelining client waits for it until its own timeout."""
    lost = 0
    for _ in range(5):
        raw = Raw(fuzzd.endpoint)
        try:
            raw.hello()
            raw.sock.send(P.encode_requests([P.Fill(2, 1 << OFFSET_BITS, 0, 0, 0), P.Close(3)]))
            raw.sock.send(P.encode_requests([P.Fence(4)]))
            ids = set()
            deadline = time.monotonic() + 1
            while {3, 4} - ids and time.monotonic() < deadline:
                if raw.sock.poll(100):
                    ids |= {r.id for r in P.decode_replies(raw.sock.recv(), REPLY_LIMITS)}
            lost += 4 not in ids
        finally:
            raw.close()
    raw = Raw(fuzzd.endpoint)
    try:  # the same inside one frame: [Close, Ping] must answer both, in one reply frame
        raw.hello()
        raw.sock.send(P.encode_requests([P.Close(5), P.Fence(6)]))
        (frame_ids,) = [[r.id for r in raw.recv()]]
    finally:
        raw.close()
    assert lost == 0 and frame_ids == [5, 6], f"{lost} of 5 Fences queued behind a Close got no reply; [Close, Fence] answered {frame_ids}"



# --- every field across its declared range ------------------------------------------------
#: Integers where widths change: a field declared u32 reaching a call that takes a C int, a
#: u64 reaching one that takes an int64, and each type's own ends.
EDGES = (0, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1,
         -1, -(1 << 31), -(1 << 63))
#: Integer fields that name memory: drawn from the session's VAs too, so a request reaches
#: past the table into what it would touch.
VA_FIELDS = {"va", "dst", "src", "graph"}


def declared(t: Any, name: str, vas: list[int]) -> st.SearchStrategy[Any]:
    """Values of a wire field's declared type (msgspec.inspect), biased to its bounds."""
    I = msgspec.inspect
    if isinstance(t, I.IntType):
        lo = -(1 << 63) if t.ge is None else t.ge
        hi = (1 << 64) - 1 if t.le is None else t.le
        ends = sorted({v for v in (*EDGES, lo, hi, lo + 1, hi - 1) if lo <= v <= hi})
        ints = st.one_of(st.sampled_from(ends), st.integers(lo, hi))
        return st.one_of(st.sampled_from(vas), ints) if name in VA_FIELDS and vas else ints
    if isinstance(t, I.BoolType):
        return st.booleans()
    if isinstance(t, I.StrType):
        return st.text(max_size=min(t.max_length or 32, 32))
    if isinstance(t, I.BytesType):
        return st.binary(max_size=min(t.max_length or 64, 64))
    if isinstance(t, (I.ListType, I.TupleType, I.VarTupleType)):
        items = t.item_types if isinstance(t, I.TupleType) else None
        if items is not None:
            return st.tuples(*(declared(i, name, vas) for i in items)).map(list)
        return st.lists(declared(t.item_type, name, vas), max_size=min(t.max_length or 4, 4))
    if isinstance(t, I.CustomType):  # a vector: packed little-endian uint64
        return st.lists(declared(I.IntType(ge=0), "va", vas), max_size=4).map(lambda xs: np.asarray(xs, "<u8").tobytes())
    if isinstance(t, I.UnionType):
        return st.one_of(*(declared(u, name, vas) for u in t.types))
    return shapes  # Any: the request's own checks decide


def declared_request(cls: type, vas: list[int]) -> st.SearchStrategy[list[Any]]:
    """[op, id, field...] of one request type, every field drawn from its declaration; trailing
    optional fields sometimes left out."""
    fields = msgspec.inspect.type_info(cls).fields[1:]
    required = sum(1 for f in fields if f.required)
    op = cls.__struct_config__.tag
    return st.integers(required, len(fields)).flatmap(
        lambda n: st.tuples(st.integers(1, (1 << 64) - 2), *(declared(f.type, f.name, vas) for f in fields[:n]))
    ).map(lambda t: [op, *t])


WIRE = sorted(P._WIRE_TYPES.items())


@DEPTHS
def test_every_declared_field_across_its_range(fuzzd, depth: int) -> None:
    """Each request type with each field drawn from its declared type, its ends first (a
    hello's pid up to 2**32-1, a stream up to 2**32-1, a u64 at 2**63): every request is
    answered, none with InternalError, and the daemon lives. The strategy is derived from
    the protocol's declarations, so a field added there is fuzzed here without a word."""
    @settings(max_examples=examples(depth), deadline=None,
              suppress_health_check=list(HealthCheck), database=None, phases=[Phase.explicit, Phase.generate])
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        raw = Raw(fuzzd.endpoint)
        try:
            hello = data.draw(declared_request(P.Hello, []))
            hello[2:3] = [P.VERSION] if len(hello) > 2 and data.draw(st.booleans()) else hello[2:3]
            replies = check_exchange(raw, [msgpack.packb([P.VERSION, [hello]], use_bin_type=True)])
            vas = [0]
            if replies and replies[0].error is None:
                seg = raw.call(P.RegisterHost(next(raw.ids) + (1 << 62), 4096))
                buf = raw.call(P.Alloc(next(raw.ids) + (1 << 62), 4096, -1))
                vas += [r.result["va"] for r in (seg, buf) if r.error is None]
            for _ in range(data.draw(st.integers(1, 3))):
                reqs = data.draw(st.lists(st.sampled_from(WIRE).flatmap(lambda w: declared_request(w[1], vas)), min_size=1, max_size=4))
                check_exchange(raw, [msgpack.packb([P.VERSION, reqs], use_bin_type=True)])
                assert fuzzd.alive(), f"daemon died on {hello!r:.200} then {reqs!r:.300}"
        finally:
            raw.close()

    run()
    assert fuzzd.alive()
    with transfer.connect(fuzzd.endpoint) as c:
        c.fence()

# --- the stateful test --------------------------------------------------------------------
MASK = (1 << OFFSET_BITS) - 1


class Seg:
    def __init__(self, sid: int, kind: str, n: int, shm: ShmFile | None) -> None:
        self.sid, self.kind, self.n, self.shm = sid, kind, n, shm
        self.data = bytearray(n)
        self.alive = True

    @property
    def va(self) -> int:
        return self.sid << OFFSET_BITS


class SessionModel(RuleBasedStateMachine):
    """One session's segments and bytes, predicted in plain Python."""

    endpoint = ""
    shm_dir = Path()
    foreign_va = 0  # a live segment of another session
    steps = collections.Counter()

    segs = Bundle("segs")

    def __init__(self) -> None:
        super().__init__()
        self.raw = Raw(self.endpoint)
        self.fd_socket = self.raw.hello(pid=os.getpid())["fd_socket"]
        self.model: dict[int, Seg] = {}

    def teardown(self) -> None:
        try:
            self.raw.call(P.Close(next(self.raw.ids)))
        finally:
            self.raw.close()
            for s in self.model.values():
                if s.shm is not None:
                    s.shm.close()

    # --- the model's address checks (docs/protocol.md order) -----------------------------
    def translate(self, va: int, n: int) -> tuple[Seg | None, int, int | None]:
        sid, off = va >> OFFSET_BITS, va & MASK
        if va == self.foreign_va or sid == self.foreign_va >> OFFSET_BITS:
            return None, 0, E.NotOwner.code
        s = self.model.get(sid)
        if s is None:
            return None, 0, E.UnknownSegment.code if sid in (0, MAX_SEGMENT_ID) else E.SegmentFreed.code
        if not s.alive:
            return None, 0, E.SegmentFreed.code
        if n > s.n - off:
            return None, 0, E.OutOfBounds.code
        return s, off, None

    def address(self, seg: Seg, off: int, mode: str) -> int:
        if mode == "foreign":
            return self.foreign_va + off
        if mode == "unknown":
            return (MAX_SEGMENT_ID << OFFSET_BITS) + off
        if mode == "zero":
            return off
        return seg.va + off

    def expect(self, reply: P.Reply, code: int | None) -> None:
        got = reply.error.code if reply.error is not None else None
        assert got == code, f"daemon said {reply.error!r}, model expected code {code}"
        self.steps[got or 0] += 1

    # --- rules ---------------------------------------------------------------------------------
    @rule(target=segs, n=st.integers(1, 8192))
    def register_host(self, n: int) -> Seg:
        r = self.raw.call(P.RegisterHost(next(self.raw.ids), n))
        self.expect(r, None)
        shm = ShmFile.attach(fetch_fd(self.fd_socket, r.result["token"]), n)
        s = Seg(r.result["va"] >> OFFSET_BITS, "host", n, shm)
        self.model[s.sid] = s
        return s

    @rule(target=segs, n=st.integers(1, 8192))
    def alloc(self, n: int) -> Seg:
        r = self.raw.call(P.Alloc(next(self.raw.ids), n, -1))
        self.expect(r, None)
        s = Seg(r.result["va"] >> OFFSET_BITS, "device", n, None)
        self.model[s.sid] = s
        return s

    @rule(seg=segs, off=st.sampled_from([0, 0, 0, 1, 4096]), wrong_kind=st.booleans(), mode=st.sampled_from(["own"] * 6 + ["foreign", "unknown", "zero"]))
    def free(self, seg: Seg, off: int, wrong_kind: bool, mode: str) -> None:
        va = self.address(seg, off, mode)
        is_host = (seg.kind == "host") != wrong_kind
        req = P.Unregister(next(self.raw.ids), va) if is_host else P.Free(next(self.raw.ids), va)
        target, _, code = self.translate(va - (va & MASK), 0)  # lookup of the segment itself
        if code is None and va & MASK:
            code = E.InvalidAddress.code
        if code is None and (target.kind == "host") != is_host:
            code = E.InvalidField.code
        self.expect(self.raw.call(req), code)
        if code is None:
            target.alive = False
            if target.shm is not None:
                target.shm.close()
                target.shm = None

    @precondition(lambda self: any(s.alive and s.kind == "host" for s in self.model.values()))
    @rule(seg=segs, off=st.integers(0, 8191), payload=st.binary(min_size=1, max_size=512))
    def write_locally(self, seg: Seg, off: int, payload: bytes) -> None:
        assume(seg.alive and seg.kind == "host")
        off %= seg.n
        payload = payload[: seg.n - off]
        seg.shm.array[off : off + len(payload)] = np.frombuffer(payload, np.uint8)
        seg.data[off : off + len(payload)] = payload

    sizes = st.one_of(st.integers(0, 8192), st.sampled_from([1 << 40, (1 << 64) - 1, 1 << 63]))
    modes = st.sampled_from(["own"] * 8 + ["foreign", "unknown", "zero"])

    @rule(dst=segs, doff=st.integers(0, 8300), dmode=modes, src=segs, soff=st.integers(0, 8300), smode=modes, n=sizes)
    def copy(self, dst: Seg, doff: int, dmode: str, src: Seg, soff: int, smode: str, n: int) -> None:
        dva, sva = self.address(dst, doff, dmode), self.address(src, soff, smode)
        d, do, code = self.translate(dva, n)
        if code is None:
            s, so, code = self.translate(sva, n)
        self.expect(self.raw.call(P.Copy(next(self.raw.ids), dva, sva, n, 0)), code)
        if code is None:
            d.data[do : do + n] = bytes(s.data[so : so + n])

    @rule(dst=segs, off=st.integers(0, 8300), mode=modes, n=sizes, value=st.integers(0, 255))
    def fill(self, dst: Seg, off: int, mode: str, n: int, value: int) -> None:
        va = self.address(dst, off, mode)
        d, do, code = self.translate(va, n)
        self.expect(self.raw.call(P.Fill(next(self.raw.ids), va, n, value, 0)), code)
        if code is None:
            d.data[do : do + n] = bytes([value]) * n

    @rule(src=segs, off=st.integers(0, 8300), mode=modes, n=sizes)
    def checksum(self, src: Seg, off: int, mode: str, n: int) -> None:
        va = self.address(src, off, mode)
        s, so, code = self.translate(va, n)
        r = self.raw.call(P.Checksum(next(self.raw.ids), va, n, 0))
        self.expect(r, code)
        if code is None:
            assert r.result == transfer.checksum64(bytes(s.data[so : so + n]))

    @invariant()
    def host_bytes_match(self) -> None:
        for s in self.model.values():
            if s.alive and s.shm is not None:
                assert s.shm.array.tobytes() == bytes(s.data), f"segment {s.sid} differs from the model"


@DEPTHS
def test_session_against_model(fuzzd, shm_dir: Path, depth: int) -> None:
    with transfer.connect(fuzzd.endpoint, name="other") as other:
        foreign = other.alloc(4096)
        other.fill(foreign, 4096, 0).result()  # make it exist in the daemon (creation may be deferred)
        SessionModel.endpoint = fuzzd.endpoint
        SessionModel.shm_dir = shm_dir
        SessionModel.foreign_va = foreign.va
        SessionModel.steps = collections.Counter()
        run_state_machine_as_test(
            SessionModel,
            settings=settings(
                max_examples=examples(depth, 15, "FUZZ_MACHINES"),
                stateful_step_count=40,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,
            ),
        )
        print(f"\nstateful: {sum(SessionModel.steps.values())} checked requests, outcomes {dict(sorted(SessionModel.steps.items()))}")
        assert fuzzd.alive()
        wait_for(lambda: other.stats()["daemon"]["segments"] == 1, "model sessions to be released", on_fail=other.stats)
        assert other.checksum(foreign).result() == transfer.checksum64(b"\0" * 4096)
    assert segment_files(shm_dir) == []
