"""Property tests for the sans-I/O protocol: round trips, and hostile bytes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import errors as E
from transfer import protocol as P
from transfer.kernels import DTYPES, TensorRef

u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
rid = st.integers(1, 2**64 - 1)
vec = st.lists(u64, max_size=50).map(lambda xs: np.array(xs, dtype=np.uint64))


@st.composite
def copyv(draw: st.DrawFn) -> P.CopyV:
    n = draw(st.integers(0, 40))
    arr = st.lists(u64, min_size=n, max_size=n).map(lambda xs: np.array(xs, dtype=np.uint64))
    return P.CopyV(draw(rid), draw(arr), draw(arr), draw(arr), draw(u32))


tensor = st.builds(
    TensorRef,
    u64,
    st.sampled_from(sorted(DTYPES)),
    st.lists(st.integers(0, 1 << 40), max_size=8).map(tuple),
).flatmap(lambda t: st.one_of(st.just(t), st.lists(st.integers(0, 1 << 40), min_size=len(t.shape), max_size=len(t.shape)).map(lambda s: TensorRef(t.va, t.dtype, t.shape, tuple(s)))))

requests = st.one_of(
    st.builds(P.Hello, rid, u32, st.text(max_size=100), u32, st.binary(max_size=100)),
    st.builds(P.Close, rid),
    st.builds(P.Ping, rid),
    st.builds(P.RegisterHost, rid, u64),
    st.builds(P.Unregister, rid, u64),
    st.builds(P.Alloc, rid, u64, st.integers(-(2**31), 2**31 - 1)),
    st.builds(P.Free, rid, u64),
    st.builds(P.RegisterRemote, rid, st.binary(max_size=64), st.binary(max_size=64), u64),
    st.builds(P.Share, rid, u64),
    st.builds(P.Attach, rid, st.binary(max_size=64)),
    st.builds(P.Copy, rid, u64, u64, u64, u32),
    copyv(),
    st.builds(P.Fill, rid, u64, u64, st.integers(0, 255), u32),
    st.builds(P.Checksum, rid, u64, u64, u32),
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
    st.builds(
        P.Define,
        rid,
        st.sampled_from([P.DEF_ALLOC, P.DEF_FREE, P.DEF_TENSOR, P.DEF_PLAN]),
        u64,
        u32,
        st.recursive(st.none() | st.integers(0, 2**64 - 1) | st.text(max_size=10), lambda i: st.lists(i, max_size=4), max_leaves=8),
        st.text(max_size=100),
    ),
    st.builds(P.Fence, rid, u32),
    st.builds(P.OpenRing, rid, u32),
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
    assert set(P.REQUEST_TYPES) == {1, 2, 3, 4, 10, 11, 12, 13, 14, 16, 17, 18, 20, 21, 22, 23, 24, 25, 30, 40, 50}


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
    (out,) = P.decode_requests(P.encode_requests([P.CopyV(1, v, v, v)]), P.Limits(max_bin=1 << 30))
    assert isinstance(out, P.BadRequest) and isinstance(out.error, E.BatchTooLarge)
