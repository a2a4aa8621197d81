"""The pure parts of transfer.transport._nixl: range checks, the descriptor wire
format, metadata name peeking, and lazy import. None of these needs NIXL."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer.errors import InvalidField, OutOfBounds, TransferError
from transfer.transport._nixl import (
    DescriptorFormatError,
    RemoteRangeError,
    check_ranges_within,
    decode_descs,
    encode_descs,
    peek_agent_name,
)

U64 = (1 << 64) - 1


# --------------------------------------------------------------------------- check_ranges_within
def test_inside_and_exact_bounds() -> None:
    reg = [(1000, 100), (5000, 10)]
    check_ranges_within(reg, [(1000, 100), (1050, 50), (5000, 10), (5009, 1)])
    check_ranges_within(reg, [])


@pytest.mark.parametrize(
    "req",
    [(999, 2), (1099, 2), (1100, 1), (0, 1), (2000, 10), (5005, 10), (4999, 2), (U64 - 1, 1)],
)
def test_outside_refused(req: tuple[int, int]) -> None:
    with pytest.raises(RemoteRangeError) as info:
        check_ranges_within([(1000, 100), (5000, 10)], [(1000, 1), req])
    assert "range 1" in str(info.value)
    assert isinstance(info.value, OutOfBounds) and isinstance(info.value, TransferError)


def test_straddling_adjacent_registrations_refused() -> None:
    # Two registrations that touch are still two remote keys.
    with pytest.raises(RemoteRangeError):
        check_ranges_within([(0x1000, 0x1000), (0x2000, 0x1000)], [(0x1800, 0x1000)])


def test_overlapping_and_unsorted_registrations() -> None:
    reg = [(500, 10), (100, 1000), (200, 10)]
    check_ranges_within(reg, [(205, 5), (900, 200), (100, 1000)])
    with pytest.raises(RemoteRangeError):
        check_ranges_within(reg, [(1095, 10)])


def test_nothing_registered() -> None:
    with pytest.raises(RemoteRangeError):
        check_ranges_within([], [(1, 1)])


@pytest.mark.parametrize("bad", [(10, 0), (-1, 5), (5, -1), (U64, 2), (1 << 64, 1), ("x", 1)])
def test_malformed_ranges(bad: tuple) -> None:
    with pytest.raises(InvalidField):
        check_ranges_within([(0, 1 << 40)], [bad])


def test_numpy_input_and_shape_checks() -> None:
    reg = np.array([[4096, 8192]], dtype=np.uint64)
    req = np.array([[4096, 1], [12287, 1]], dtype=np.int64)
    check_ranges_within(reg, req)
    with pytest.raises(InvalidField):
        check_ranges_within(reg, np.zeros((2, 3), np.uint64))
    with pytest.raises(InvalidField):
        check_ranges_within(reg, np.array([[-4, 1]], np.int64))
    with pytest.raises(InvalidField):
        check_ranges_within(reg, np.array([[1.0, 1.0]]))


ranges = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 1 << 12)), max_size=8)


@settings(max_examples=300, deadline=None)
@given(reg=ranges, req=ranges)
def test_matches_brute_force(reg: list[tuple[int, int]], req: list[tuple[int, int]]) -> None:
    expect = all(any(a <= b and b + m <= a + n for a, n in reg) for b, m in req)
    try:
        check_ranges_within(reg, req)
        ok = True
    except RemoteRangeError:
        ok = False
    assert ok == expect


def test_large_batch_is_fast() -> None:
    import time

    reg = np.stack([np.arange(1000, dtype=np.uint64) << 20, np.full(1000, 1 << 16, np.uint64)], 1)
    rng = np.random.default_rng(0)
    seg = rng.integers(0, 1000, 100_000).astype(np.uint64)
    off = rng.integers(0, (1 << 16) - 64, 100_000).astype(np.uint64)
    req = np.stack([(seg << np.uint64(20)) + off, np.full(100_000, 64, np.uint64)], 1)
    t0 = time.perf_counter()
    check_ranges_within(reg, req)
    assert time.perf_counter() - t0 < 0.5


# --------------------------------------------------------------------------- descriptor wire format
def test_roundtrip() -> None:
    data = encode_descs([(0x7F0000001000, 4096), (1, 2)], "DRAM", 0)
    assert len(data) == 16 + 2 * 16
    d = decode_descs(data)
    assert d.mem_type == "DRAM" and d.dev_id == 0 and len(d) == 2
    assert d.ranges.tolist() == [[0x7F0000001000, 4096], [1, 2]]
    v = decode_descs(encode_descs(np.array([[8, 8]], np.uint64), "VRAM", 3))
    assert (v.mem_type, v.dev_id) == ("VRAM", 3)
    assert len(decode_descs(encode_descs([]))) == 0


def _mutate(data: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


@pytest.mark.parametrize(
    "mutation",
    [
        lambda d: d[:10],
        lambda d: d[:-1],
        lambda d: d + b"\0",
        lambda d: b"XXXX" + d[4:],
        lambda d: _mutate(d, 4, "<B", 2),  # version
        lambda d: _mutate(d, 5, "<B", 7),  # mem type
        lambda d: _mutate(d, 6, "<H", 1),  # reserved
        lambda d: _mutate(d, 12, "<I", 3),  # count disagrees with length
        lambda d: _mutate(d, 12, "<I", 0xFFFFFFFF),  # huge count
        lambda d: _mutate(d, 24, "<Q", 0),  # zero length
        lambda d: _mutate(d, 16, "<Q", U64),  # address + length overflows
        lambda d: pickle_payload(),
    ],
)
def test_malformed_descs_refused(mutation) -> None:
    good = encode_descs([(0x1000, 64)])
    with pytest.raises(DescriptorFormatError):
        decode_descs(mutation(good))


def pickle_payload() -> bytes:
    """What nixl_agent.get_serialized_descs produces: pickle. Never load it from a peer."""
    import pickle

    return pickle.dumps(("nixl", 1))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_format_errors(data: bytes) -> None:
    try:
        d = decode_descs(data)
    except DescriptorFormatError:
        return
    assert d.ranges.ndim == 2


def test_encode_refuses_bad_input() -> None:
    with pytest.raises(InvalidField):
        encode_descs([(1, 1)], "FILE")
    with pytest.raises(InvalidField):
        encode_descs([(1, 0)])
    with pytest.raises(InvalidField):
        encode_descs([(1, 1)], dev_id=-1)


# --------------------------------------------------------------------------- metadata name
def test_peek_agent_name() -> None:
    md = b"nixlSerDes|Agent" + struct.pack("<Q", 5) + b"alice|Conns..."
    assert peek_agent_name(md) == "alice"
    for bad in [b"", b"nixlSerDes|Agent", b"garbage" * 10, b"nixlSerDes|Agent" + struct.pack("<Q", 1 << 40) + b"x"]:
        with pytest.raises(DescriptorFormatError):
            peek_agent_name(bad)


# --------------------------------------------------------------------------- lazy import
def test_module_imports_without_nixl_and_names_the_extra() -> None:
    code = (
        "import sys\n"
        "import transfer.transport._nixl as m\n"
        "assert not any(k.startswith('nixl') for k in sys.modules), sorted(k for k in sys.modules if 'nixl' in k)\n"
        "assert m.available() is False\n"
        "try:\n"
        "    m.NixlEndpoint('x')\n"
        "except ImportError as e:\n"
        "    assert isinstance(e, m.NixlUnavailable) and 'rdma' in str(e) and '--no-deps' in str(e), e\n"
        "    print('OK')\n"
    )
    env = dict(os.environ, TRANSFER_NIXL_MODULE="no_such_nixl_module")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr


@pytest.mark.parametrize("n", [1, 4, 16, 17, 64])
def test_range_faults_name_the_first_bad_range_at_any_length(n: int) -> None:
    """One scan finds that a list has a fault, then the first one is named: a zero length
    before an earlier overflow, at every list length."""
    reg = np.array([[0, U64]], np.uint64)
    ok = np.array([[4096 * (i + 1), 8] for i in range(n)], np.uint64)
    check_ranges_within(reg, ok)
    zero, over = ok.copy(), ok.copy()
    zero[n - 1, 1] = 0
    over[0] = (U64 - 3, 8)
    with pytest.raises(InvalidField, match=f"range {n - 1} has length 0"):
        check_ranges_within(reg, zero)
    with pytest.raises(InvalidField, match=rf"range 0 \({U64 - 3}, 8\) overflows 64 bits"):
        check_ranges_within(reg, over)
    if n > 1:
        over[n - 1, 1] = 0
        with pytest.raises(InvalidField, match=f"range {n - 1} has length 0"):
            check_ranges_within(reg, over)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, U64), st.integers(0, U64)), max_size=6))
def test_a_list_of_ranges_is_checked_as_an_array_of_them_is(pairs: list[tuple[int, int]]) -> None:
    """A few pairs are checked in Python, an array in NumPy: the same ranges pass, and the same
    ones fail."""
    from transfer.transport._nixl import _as_ranges

    def outcome(ranges: object) -> object:
        try:
            return _as_ranges(ranges, "r").tolist()  # type: ignore[arg-type]
        except InvalidField:
            return InvalidField

    assert outcome(pairs) == outcome(np.array(pairs, dtype=np.uint64).reshape(-1, 2))
