"""Property tests for the sans-I/O protocol: round trips, and hostile bytes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import errors as E
from transfer import protocol as P
from transfer import _native
from transfer.kernels import DTYPES, TensorRef

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
rid = st.integers(1, 2**64 - 1)
vec = st.lists(u64, max_size=50).map(lambda xs: np.array(xs, dtype=np.uint64))


@st.composite
def copyv(draw: st.DrawFn) -> P.CopyV:
    n = draw(st.integers(0, 40))
    arr = st.lists(u64, min_size=n, max_size=n).map(lambda xs: np.array(xs, dtype=np.uint64))
    return P.CopyV(draw(rid), draw(arr), draw(arr), draw(arr), draw(u32), draw(st.booleans()))


@st.composite
def checksumv(draw: st.DrawFn) -> P.ChecksumV:
    n = draw(st.integers(0, 40))
    arr = st.lists(u64, min_size=n, max_size=n).map(lambda xs: np.array(xs, dtype=np.uint64))
    return P.ChecksumV(draw(rid), draw(arr), draw(arr), draw(u32))


tensor = st.builds(
    TensorRef,
    u64,
    st.sampled_from(sorted(DTYPES)),
    # Valid tensors present at most 2**40 bytes of elements and span at most 2**40 bytes.
    st.one_of(st.lists(st.integers(0, 1 << 4), max_size=8), st.lists(st.integers(0, 1 << 20), max_size=1)).map(tuple),
).flatmap(lambda t: st.one_of(st.just(t), st.lists(st.integers(0, 1 << 19), min_size=len(t.shape), max_size=len(t.shape)).map(lambda s: TensorRef(t.va, t.dtype, t.shape, tuple(s)))))

requests = st.one_of(
    st.builds(P.Hello, rid, u32, st.text(max_size=100), st.integers(0, P.PID_MAX), st.binary(max_size=100)),
    st.builds(P.Close, rid),
    st.builds(P.Ping, rid),
    st.builds(P.RegisterHost, rid, u64),
    st.builds(P.Unregister, rid, u64),
    st.builds(P.Alloc, rid, u64, st.integers(-(2**31), 2**31 - 1)),
    st.builds(P.Free, rid, u64),
    st.builds(P.RegisterRemote, rid, st.binary(max_size=64), st.binary(max_size=64), u64, u64, st.text(max_size=64)),
    st.builds(P.Share, rid, u64),
    st.builds(P.Attach, rid, st.binary(max_size=64)),
    st.builds(P.Copy, rid, u64, u64, u64, u32),
    copyv(),
    st.builds(P.Fill, rid, u64, u64, st.integers(0, 255), u32),
    st.builds(P.Checksum, rid, u64, u64, u32),
    checksumv(),
    st.builds(
        P.Compute,
        rid,
        st.text(max_size=64),
        st.lists(tensor, max_size=4),
        st.lists(tensor, max_size=4),
        st.dictionaries(st.text(max_size=10), st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=20) | st.lists(st.floats(allow_nan=False), max_size=5), max_size=5),
        st.integers(-(2**31), 2**31 - 1),
        st.text(max_size=32),
        u32,
    ),
    st.builds(P.Wait, rid),
    st.builds(
        P.ComputeRef,
        rid,
        st.lists(st.tuples(u64, u32), min_size=1, max_size=1),
        st.lists(st.tuples(u64, u32), max_size=4),
        st.lists(st.tuples(u64, u32), max_size=4),
        u32,
    ),
    st.builds(P.RunGraph, rid, u64, st.lists(u64, max_size=16), st.lists(u64, max_size=16), st.booleans(), u32),
    st.builds(
        P.Define,
        rid,
        st.sampled_from([P.DEF_ALLOC, P.DEF_FREE, P.DEF_TENSOR, P.DEF_PLAN, P.DEF_GRAPH]),
        u64,
        u32,
        st.recursive(st.none() | st.integers(0, 2**64 - 1) | st.text(max_size=10), lambda i: st.lists(i, max_size=4), max_leaves=8),
        st.text(max_size=100),
    ),
    st.builds(P.Fence, rid, u32),
    st.builds(P.OpenRing, rid, u32),
    st.builds(P.OpenChannel, rid, u32),
    st.builds(P.RingMark, rid, u64),
    st.builds(P.Stats, rid),
)


def same(a: P.Request, b: P.Request) -> bool:
    if type(a) is not type(b):
        return False
    for name in a.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, dict):
            if x.keys() != y.keys() or any(repr(x[k]) != repr(y[k]) for k in x):
                return False
        elif isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return a.id == b.id


def test_every_message_type_is_covered() -> None:
    assert set(P.REQUEST_TYPES) == {1, 2, 3, 4, 5, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 30, 40, 50}


@given(st.lists(requests, min_size=1, max_size=20))
def test_request_round_trip(reqs: list[P.Request]) -> None:
    back = P.decode_requests(P.encode_requests(reqs))
    assert len(back) == len(reqs)
    for a, b in zip(reqs, back):
        assert not isinstance(b, P.BadRequest), b
        assert same(a, b)


results = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
error_classes = st.sampled_from([E.OutOfBounds, E.NotOwner, E.MalformedFrame, E.QuotaExceeded, E.InternalError])


@given(st.lists(st.one_of(st.builds(P.Reply, rid, results), st.builds(lambda i, c, m: P.Reply(i, error=c(m)), rid, error_classes, st.text(max_size=50))), max_size=20))
def test_reply_round_trip(replies: list[P.Reply]) -> None:
    back = P.decode_replies(P.encode_replies(replies))
    assert len(back) == len(replies)
    for a, b in zip(replies, back):
        assert a.id == b.id
        if a.error is None:
            assert b.error is None and b.result == a.result
        else:
            assert type(b.error) is type(a.error) and b.error.message == a.error.message


def decode_never_crashes(data: bytes) -> None:
    try:
        out = P.decode_requests(data)
    except E.ProtocolError:
        return
    for item in out:
        assert isinstance(item, (P.Request, P.BadRequest))
        if isinstance(item, P.BadRequest):
            assert isinstance(item.error, E.ProtocolError)


@settings(max_examples=500)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_give_protocol_errors_only(data: bytes) -> None:
    decode_never_crashes(data)
    try:
        P.decode_replies(data)
    except E.ProtocolError:
        pass


@settings(max_examples=500)
@given(st.lists(requests, min_size=1, max_size=5), st.data())
def test_mutated_frames_give_protocol_errors_only(reqs: list[P.Request], data: st.DataObject) -> None:
    frame = bytearray(P.encode_requests(reqs))
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(len(frame) - 1, 0)))
        if op == "flip" and frame:
            frame[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del frame[pos:]
        else:
            frame[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    decode_never_crashes(bytes(frame))


structured = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=10) | st.binary(max_size=24),
    lambda inner: st.lists(inner, max_size=6),
    max_leaves=20,
)


@settings(max_examples=500)
@given(st.sampled_from(sorted(P.REQUEST_TYPES)), rid, st.lists(structured, max_size=6))
def test_well_framed_garbage_fields_fail_alone(op: int, r: int, fields: list[object]) -> None:
    """A request with bad fields becomes a BadRequest carrying its id; its neighbours decode."""
    good = [P.Ping.OP, 7]
    frame = msgpack.packb([P.VERSION, [good, [op, r, *fields], good]], use_bin_type=True)
    out = P.decode_requests(frame)
    assert isinstance(out[0], P.Ping) and isinstance(out[2], P.Ping)
    if isinstance(out[1], P.BadRequest):
        assert out[1].id == r and isinstance(out[1].error, E.ProtocolError)


@pytest.mark.parametrize(
    "frame, err",
    [
        (msgpack.packb([2, []]), E.UnsupportedVersion),
        (msgpack.packb({"v": 1}), E.MalformedFrame),
        (b"\xc1", E.MalformedFrame),
        (msgpack.packb([1, [[P.Ping.OP, 1]]])[:-1], E.MalformedFrame),
        (b"\x00" * ((4 << 20) + 1), E.FrameTooLarge),
        (msgpack.packb([1, [[3, i + 1] for i in range(70000)]]), E.BatchTooLarge),
    ],
)
def test_frame_level_errors(frame: bytes, err: type[Exception]) -> None:
    with pytest.raises(err):
        P.decode_requests(frame)


@pytest.mark.parametrize(
    "item, err",
    [
        ([99, 1], E.UnknownOperation),
        ([20, 1, 0, 0], E.InvalidField),  # Copy with too few fields
        ([20, 1, -1, 0, 0, 0], E.InvalidField),  # negative VA
        ([20, 1, 0, 0, 0, 2**32], E.InvalidField),  # stream beyond u32
        ([20, 1, 0, 0, 1.5, 0], E.InvalidField),  # float size
        ([20, 1, True, 0, 0, 0], E.InvalidField),  # bools are not ints
        ([21, 1, b"1234567", b"", b"", 0], E.InvalidField),  # vector not a multiple of 8
        ([21, 1, b"\0" * 8, b"", b"", 0], E.InvalidField),  # vector lengths differ
        ([22, 1, 0, 0, 256, 0], E.InvalidField),  # fill value beyond u8
    ],
)
def test_field_validation(item: list[object], err: type[Exception]) -> None:
    (out,) = P.decode_requests(msgpack.packb([1, [item]], use_bin_type=True))
    assert isinstance(out, P.BadRequest) and isinstance(out.error, err)


def test_vector_limit() -> None:
    n = P.DEFAULT_LIMITS.max_vector + 1
    v = np.zeros(n, np.uint64)
    for req in (P.CopyV(1, v, v, v), P.ChecksumV(2, v, v)):
        (out,) = P.decode_requests(P.encode_requests([req]), P.Limits(max_bin=1 << 30))
        assert isinstance(out, P.BadRequest) and isinstance(out.error, E.BatchTooLarge)


# --- frame limits, fast and slow path ------------------------------------------------
def _pings(n: int) -> list[list[int]]:
    return [[P.Ping.OP, i + 1] for i in range(n)]


def test_batch_limit_is_exact() -> None:
    """65,537 requests are refused as BatchTooLarge before decoding (not MalformedFrame); 65,536 pass."""
    limit = P.DEFAULT_LIMITS.max_batch
    assert len(P.decode_requests(msgpack.packb([1, _pings(limit)]))) == limit
    with pytest.raises(E.BatchTooLarge):
        P.decode_requests(msgpack.packb([1, _pings(limit + 1)]))
    with pytest.raises(E.BatchTooLarge):  # one bad request sends the frame down the slow path
        P.decode_requests(msgpack.packb([1, [[P.Ping.OP, 0]] + _pings(limit)]))
    with pytest.raises(E.BatchTooLarge):
        P.decode_replies(msgpack.packb([1, [[i + 1, 0, None] for i in range(limit + 1)]]))
    with pytest.raises(E.BatchTooLarge):
        P.decode_requests(msgpack.packb([1, _pings(5)]), P.Limits(max_batch=4))


def test_non_canonical_header_takes_the_slow_path() -> None:
    """A version written as uint8 (legal msgpack, never what we send) still decodes, limits and all."""
    body = msgpack.packb(_pings(3))
    assert [r.id for r in P.decode_requests(b"\x92\xcc\x01" + body)] == [1, 2, 3]
    assert [r.id for r in P.decode_replies(b"\x92\xcc\x01" + msgpack.packb([[1, 0, None]]))] == [1]
    with pytest.raises(E.BatchTooLarge):
        P.decode_requests(b"\x92\xcc\x01" + body, P.Limits(max_batch=2))
    with pytest.raises(E.UnsupportedVersion):
        P.decode_requests(b"\x92\xcc\x02" + body)


@pytest.mark.parametrize(
    "frame, err",
    [
        (msgpack.packb([True, []]), E.MalformedFrame),
        (msgpack.packb([1, "x"]), E.MalformedFrame),
        (msgpack.packb([1, []]) + b"\x00", E.MalformedFrame),  # trailing bytes
        (msgpack.packb([1, msgpack.ExtType(1, b"x")]), E.MalformedFrame),
        (b"\x92\x01" + b"\x91" * 200_000 + b"\xc0", E.MalformedFrame),  # nesting beyond the decoder's depth
    ],
)
def test_more_frame_level_errors(frame: bytes, err: type[Exception]) -> None:
    with pytest.raises(err):
        P.decode_requests(frame)
    with pytest.raises(E.ProtocolError):
        P.decode_replies(frame)


# --- per-request errors: exact messages and isolation -----------------------------
@pytest.mark.parametrize(
    "item, err, message",
    [
        ([20, 1, -1, 0, 0, 0], E.InvalidField, "Copy.dst: expected `int` >= 0, got -1"),
        ([20, 1, 0, 0, 0, 2**32], E.InvalidField, "Copy.stream: expected `int` <= 4294967295, got 4294967296"),
        ([20, 1, 0, 0, 1.5, 0], E.InvalidField, "Copy.nbytes: expected `int`, got `float` (1.5)"),
        ([20, 1, 0, 0], E.InvalidField, "Copy takes 3 to 4 fields, got 2"),
        ([20, 1, 0, 0, 0, 0, 0], E.InvalidField, "Copy takes 3 to 4 fields, got 5"),
        ([3, 1, 0], E.InvalidField, "Ping takes 0 fields, got 1"),
        ([21, 1, b"1234567", b"", b"", 0], E.InvalidField, "CopyV.dst: length 7 is not a multiple of 8"),
        ([21, 1, b"", "x", b"", 0], E.InvalidField, "CopyV.src: expected packed uint64 bytes, got str"),
        ([21, 1, b"\0" * 8, b"", b"", 0], E.InvalidField, "CopyV: its vectors must have the same length"),
        ([27, 1, b"\0" * 8, b"", 0], E.InvalidField, "ChecksumV: its vectors must have the same length"),
        ([21, 1, b"", b"", b"", 0, 1], E.InvalidField, "CopyV.sums: expected `bool`, got `int`"),
        ([1, 1, 1, "x" * 257, 0, b""], E.InvalidField, "Hello.client: expected `str` of length <= 256"),
        ([17, 1, b"\0" * 65], E.InvalidField, "Attach.token: expected `bytes` of length <= 64"),
        ([25, 1, [[1, 2, 3]], [], []], E.InvalidField, "ComputeRef.plan[0]: expected `array` of length 2, got 3"),
        ([25, 1, [[1, -2]], [], []], E.InvalidField, "ComputeRef.plan[0][1]: expected `int` >= 0"),
        ([24, 1, "fill", [[0, "foo", [], None]], [], {}], E.InvalidField, "Compute.inputs[0].dtype: 'foo' is not one of"),
        ([24, 1, "fill", [], [], {"k": {}}], E.InvalidField, "Compute.params.k: unsupported parameter type dict"),
        ([50, 1, 1, 2, 0, [[[[[[0]]]]]]], E.InvalidField, "Define.definition: nested deeper than 4"),
        ([50, 1, 1, 2, 0, msgpack.ExtType(1, b"")], E.InvalidField, "Define.definition: unsupported type Ext"),
        ([20, 0, 0, 0, 0, 0], E.MalformedFrame, "request id must be an integer"),
        ([20, "1", 0, 0, 0, 0], E.MalformedFrame, "request id must be an integer"),
        ([99, 1], E.UnknownOperation, "unknown operation 99"),
        (5, E.MalformedFrame, "a request is [op, id, field...]"),
    ],
)
def test_error_messages_name_the_field(item: object, err: type[Exception], message: str) -> None:
    good = [P.Ping.OP, 7]
    before, out, after = P.decode_requests(msgpack.packb([1, [good, item, good]], use_bin_type=True))
    assert isinstance(before, P.Ping) and isinstance(after, P.Ping)
    assert isinstance(out, P.BadRequest) and type(out.error) is err, out
    assert message in out.error.message, out.error.message
    if err is E.InvalidField or err is E.UnknownOperation:
        assert out.id == 1


def test_invalid_utf8_fails_only_its_request() -> None:
    hello = msgpack.packb([1, 5, 1, "client", 0, b""]).replace(b"client", b"\xffclien")
    frame = b"\x92\x01\x93" + msgpack.packb([3, 1]) + hello + msgpack.packb([3, 2])
    a, bad, b = P.decode_requests(frame)
    assert isinstance(a, P.Ping) and isinstance(b, P.Ping)
    assert isinstance(bad, P.BadRequest) and bad.id == 5 and isinstance(bad.error, E.InvalidField)
    assert bad.error.message.startswith("Hello.client:")


def test_trailing_defaults_may_be_omitted() -> None:
    """msgspec semantics: a trailing field with a default may be left out (we always send it)."""
    (c,) = P.decode_requests(msgpack.packb([1, [[20, 1, 2, 3, 4]]]))
    assert c == P.Copy(1, 2, 3, 4, 0)


@st.composite
def frame_with_one_bad(draw: st.DrawFn) -> tuple[list[P.Request], int, bytes]:
    reqs = draw(st.lists(requests, min_size=1, max_size=6))
    i = draw(st.integers(0, len(reqs) - 1))
    items = msgpack.unpackb(P.encode_requests(reqs))[1]
    spoil = draw(st.sampled_from(["extra", "ext"] if len(items[i]) > 2 else ["extra"]))
    if spoil == "extra":
        items[i].append(0)
    else:
        items[i][draw(st.integers(2, len(items[i]) - 1))] = msgpack.ExtType(5, b"x")
    return reqs, i, msgpack.packb([P.VERSION, items], use_bin_type=True)


@settings(max_examples=200)
@given(frame_with_one_bad())
def test_one_bad_request_fails_alone(case: tuple[list[P.Request], int, bytes]) -> None:
    reqs, i, frame = case
    out = P.decode_requests(frame)
    assert len(out) == len(reqs)
    for k, (a, b) in enumerate(zip(reqs, out)):
        if k == i:
            assert isinstance(b, P.BadRequest) and b.id == a.id and isinstance(b.error, E.InvalidField), b
            assert b.error.message.startswith(type(a).__name__), b.error.message
        else:
            assert same(a, b)


# --- replies ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body",
    [
        [[1, 0, msgpack.ExtType(1, b"x")]],
        [[1, 0, {1: 2}]],
        [[1, 0, None, "extra"]],
        [[1, 5, "Name"]],
        [[1, 5, "Name", None]],
        [[1, -1, "Name", "m"]],
        [["1", 0, None]],
        [[1, 0, "x" * 5000]],
        [[1, 0, {str(k): k for k in range(65)}]],
    ],
)
def test_malformed_replies(body: list[object]) -> None:
    with pytest.raises(E.MalformedFrame):
        P.decode_replies(msgpack.packb([1, body], use_bin_type=True))


def test_deep_reply_results_are_refused() -> None:
    deep: list[object] = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(E.MalformedFrame):
        P.decode_replies(msgpack.packb([1, [[1, 0, deep]]]))


def test_public_surface() -> None:
    """What the server and client rely on, beyond names: positional construction, OP, arrays."""
    c = P.Copy(1, 2, 3, 4)
    assert (c.id, c.stream, P.Copy.OP, isinstance(c, P.Request)) == (1, 0, 20, True)
    c.stream = 3  # requests stay mutable
    assert P.Reply(5).result is None and P.Reply(5, error=E.NotOwner("x")).error is not None
    v = P.decode_requests(P.encode_requests([P.CopyV(1, [1, 2], np.array([3, 4]), np.array([5, 6], np.uint64))]))[0]
    assert isinstance(v, P.CopyV) and v.dst.dtype == np.dtype("<u8") and v.src.tolist() == [3, 4]
    assert all(P.REQUEST_TYPES[op].OP == op for op in P.REQUEST_TYPES)
    assert isinstance(P.decode_request(msgpack.packb([20, 1, 0, 0, 0, 0])), P.Copy)
    assert isinstance(P.decode_request([20, 1, -1, 0, 0, 0]), P.BadRequest)


def test_tensors_beyond_the_largest_segment_are_refused() -> None:
    """Dims whose product (times the itemsize) or whose extent passes 2**40 bytes never decode."""
    from transfer._fields import tensors

    tensors([[0, "uint8", [1 << 20, 1 << 20], None]], "t")
    for bad in ([[0, "uint8", [1 << 20, (1 << 20) + 1], None]], [[0, "float64", [1 << 38], [0]]],
                [[0, "uint8", [1 << 40, 1 << 40, 1 << 40], [0, 0, 0]]], [[0, "uint8", [3], [1 << 40]]]):
        with pytest.raises(E.InvalidField):
            tensors(bad, "t")


# --- the client's reading of replies (sans-I/O: ClientCore takes frames, no daemon) ------------
@given(st.lists(u64, min_size=1, max_size=20), st.integers(-8, 8))
def test_checksum_many_reply_is_checked(sums: list[int], skew: int) -> None:
    """A ChecksumV sent on the socket is answered with one packed uint64 per range; a reply
    of any other length (or type) fails that request, clearly, and nothing else."""
    from transfer.client._core import ClientCore
    from transfer._pending import Pending

    core = ClientCore(Pending, lambda p, t: None)
    v = np.zeros(len(sums), np.uint64)
    req, p = core.new(P.ChecksumV, v, v, 0)
    other, q = core.new(P.Checksum, 0, 8, 0)
    core.encode([req, other])
    body = np.array(sums, "<u8").tobytes()
    body = body + b"\0" * skew if skew >= 0 else body[:skew]
    core.on_frame(P.encode_replies([P.Reply(req.id, body), P.Reply(other.id, 5)]))
    assert q.done() and q.result() == 5 and not core.sums
    if skew == 0:
        assert p.result().dtype == np.uint64 and p.result().tolist() == sums
    else:
        with pytest.raises(E.ProtocolError, match="checksums"):
            p.result()


_INTS = st.one_of(
    st.integers(min_value=-(1 << 65), max_value=1 << 65),
    st.sampled_from([0, 255, 256, (1 << 32) - 1, 1 << 32, (1 << 64) - 1, 1 << 64, -1]),
    st.booleans(), st.floats(allow_nan=False), st.just(np.uint64(7)), st.just(np.int64(-3)), st.none(),
)


@settings(max_examples=400, deadline=None)
@given(cls=st.sampled_from([P.Copy, P.Fill, P.Checksum]), args=st.lists(_INTS, min_size=0, max_size=4))
def test_native_int_check_agrees_with_check_ints(cls: type, args: list[object]) -> None:
    """The native fast check (`ints_within`) the client submits through says yes only where
    check_ints accepts, and for exact ints says exactly what check_ints says."""
    within = _native.ints_within
    args_t = tuple(args)
    try:
        P.check_ints(cls, args_t)
        ok = True
    except E.InvalidField:
        ok = False
    fast = within(args_t, P.int_bounds(cls))
    if fast:
        assert ok
    if all(type(a) is int for a in args_t):
        assert fast == ok
