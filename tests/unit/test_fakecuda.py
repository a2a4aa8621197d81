"""The fake CUDA driver (tests/fakecuda) keeps the promises the device tests rely on: queued
work has not run when the call returns, an event passes only after the work before it, copy
destinations in host memory are poisoned until the copy runs, a pageable source is read when
the copy is queued, misuse is counted, and an injected fault is sticky. Driven through ctypes
in a process of its own, with the engine held (`fakecuda_pause`) while a test looks at what is
queued: nothing here depends on how fast the engine thread is scheduled."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import fakecuda

ILLEGAL_ADDRESS = 700


def _script(body: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run `body` in a fresh process with the fake loaded as `cu` (its globals are per process)."""
    prelude = textwrap.dedent(f"""
        import ctypes, numpy as np
        cu = ctypes.CDLL({str(fakecuda.build())!r})
        P = ctypes.c_ulonglong
        cu.cuMemcpyAsync.argtypes = [P, P, ctypes.c_size_t, ctypes.c_void_p]
        cu.cuMemsetD8Async.argtypes = [P, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
        cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
        cu.cuMemFree_v2.argtypes = [P]
        cu.cuEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        cu.cuEventQuery.argtypes = cu.cuEventSynchronize.argtypes = cu.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        cu.fakecuda_violations.restype = cu.fakecuda_executed.restype = ctypes.c_uint64
        assert cu.cuInit(0) == 0
        ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert cu.cuCtxSetCurrent(ctx) == 0
        def stream():
            s = ctypes.c_void_p(); assert cu.cuStreamCreate(ctypes.byref(s), 1) == 0; return s
        def event():
            e = ctypes.c_void_p(); assert cu.cuEventCreate(ctypes.byref(e), 2) == 0; return e
        def alloc(n):
            p = P(); assert cu.cuMemAlloc_v2(ctypes.byref(p), n) == 0; return p.value
        def view(ptr, n):
            return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))
        BIG = 64 << 20
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def _ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_queued_work_runs_later_in_order_and_events_wait_for_it() -> None:
    out = _ok(_script("""
        s, e = stream(), event()
        d, h = alloc(BIG), np.zeros(BIG, np.uint8)
        assert cu.cuMemHostRegister_v2(h.ctypes.data, BIG, 1) == 0
        src = np.full(BIG, 3, np.uint8); assert cu.cuMemHostRegister_v2(src.ctypes.data, BIG, 1) == 0
        cu.fakecuda_pause(1)  # nothing runs until it is let go
        for _ in range(2):
            assert cu.cuMemcpyAsync(d, src.ctypes.data, BIG, s) == 0
        assert cu.cuMemsetD8Async(d, 9, 16, s) == 0
        assert cu.cuMemcpyAsync(h.ctypes.data, d, BIG, s) == 0
        assert (h[:16] == 0xDB).all()           # poisoned until the copy runs
        assert cu.cuEventRecord(e, s) == 0
        assert cu.cuEventQuery(e) == 600        # not ready: the work before it has not run
        cu.fakecuda_pause(0)
        assert cu.cuEventSynchronize(e) == 0 and cu.cuEventQuery(e) == 0
        assert (h[:16] == 9).all() and (h[16:] == 3).all()   # in stream order
        print("violations", cu.fakecuda_violations())
    """))
    assert "violations 0" in out


def test_a_pageable_source_is_read_when_queued_and_a_pageable_destination_waits() -> None:
    _ok(_script("""
        s = stream()
        d = alloc(4096)
        src = np.full(4096, 5, np.uint8)        # not registered: pageable
        assert cu.cuMemcpyAsync(d, src.ctypes.data, 4096, s) == 0
        src[:] = 6                              # the caller may reuse it at once
        back = np.zeros(4096, np.uint8)
        assert cu.cuMemcpyAsync(back.ctypes.data, d, 4096, s) == 0
        assert (back == 5).all()                # into pageable memory: done when the call returns
    """))


def test_misuse_is_counted() -> None:
    out = _ok(_script("""
        s = stream()
        d = alloc(BIG)
        h = np.zeros(2 * BIG, np.uint8)
        assert cu.cuMemHostRegister_v2(h.ctypes.data, BIG, 1) == 0
        assert cu.cuMemHostRegister_v2(h.ctypes.data + 4096, 4096, 1) == 712        # overlapping registration
        assert cu.cuMemcpyAsync(d + BIG - 8, h.ctypes.data, 64, s) == 1              # past the allocation's end
        assert cu.cuMemcpyAsync(h.ctypes.data + BIG - 8, d, 64, s) == 1              # straddles the registration
        cu.fakecuda_pause(1)
        assert cu.cuMemcpyAsync(d, h.ctypes.data, BIG, s) == 0
        assert cu.cuMemHostUnregister(h.ctypes.data) == 0                           # while queued work reads it
        cu.fakecuda_pause(0)
        assert cu.cuStreamSynchronize(s) == 0
        print("violations", cu.fakecuda_violations())
    """))
    assert int(out.split()[-1]) >= 4, out


def test_an_injected_fault_is_sticky() -> None:
    out = _ok(_script("""
        s, e = stream(), event()
        d, h = alloc(4096), np.zeros(4096, np.uint8)
        assert cu.cuMemHostRegister_v2(h.ctypes.data, 4096, 1) == 0
        codes = []
        for _ in range(4):
            codes.append(cu.cuMemcpyAsync(d, h.ctypes.data, 4096, s))
            cu.cuEventRecord(e, s)
            codes.append(cu.cuEventSynchronize(e))
        print(codes)
    """, FAKECUDA_FAULT_AT="2"))
    codes = eval(out.strip())
    assert codes[:2] == [0, 0] and codes[3] == ILLEGAL_ADDRESS and set(codes[4:]) == {ILLEGAL_ADDRESS}, codes


#: A registered host buffer `h` of 4s, a device buffer `d` holding them, `other` (64 bytes of
#: device memory), stream `s` and event `e`.
_FOURS = """
        s, e = stream(), event()
        d, h = alloc(BIG), np.full(BIG, 4, np.uint8)
        assert cu.cuMemHostRegister_v2(h.ctypes.data, BIG, 1) == 0
        other = alloc(64)
        assert cu.cuMemcpyAsync(d, h.ctypes.data, BIG, s) == 0 and cu.cuStreamSynchronize(s) == 0
"""


def test_poison_never_reaches_work_queued_before_it() -> None:
    """A copy out of registered host memory, then one into the same bytes, on one stream: the
    first reads the bytes as they were (stream order), though the second poisons them when
    queued; readers of the poisoned bytes afterwards see the poison until it has run."""
    _ok(_script(_FOURS + """
        cu.fakecuda_pause(1)  # both are queued before either runs
        assert cu.cuMemcpyAsync(other, h.ctypes.data, 64, s) == 0     # reads h[:64] = 4
        assert cu.cuMemcpyAsync(h.ctypes.data, d + 64, 64, s) == 0    # then writes it (poisoned now)
        assert (h[:64] == 0xDB).all()
        assert cu.cuEventRecord(e, s) == 0
        cu.fakecuda_pause(0)
        assert cu.cuEventSynchronize(e) == 0
        assert (view(other, 64) == 4).all() and (h[:64] == 4).all()
    """))


def test_a_reader_between_two_writes_sees_the_first_write() -> None:
    """On one stream: a copy into registered host bytes, a copy out of them, a copy into them
    again, all queued before any runs. The reader sees what the first write leaves (stream
    order), not the second write's poison; in the end the bytes hold the second write."""
    _ok(_script(_FOURS + """
        view(d, 128)[64:] = 9
        cu.fakecuda_pause(1)
        assert cu.cuMemcpyAsync(h.ctypes.data, d, 64, s) == 0         # h[:64] = 4 (poisoned now)
        assert cu.cuMemcpyAsync(other, h.ctypes.data, 64, s) == 0     # reads h[:64]: the 4s
        assert cu.cuMemcpyAsync(h.ctypes.data, d + 64, 64, s) == 0    # then h[:64] = 9
        assert cu.cuEventRecord(e, s) == 0
        cu.fakecuda_pause(0)
        assert cu.cuEventSynchronize(e) == 0
        assert (view(other, 64) == 4).all() and (h[:64] == 9).all()
    """))


def test_capture_records_and_each_launch_replays_in_stream_order() -> None:
    """Between begin and end capture nothing runs; each launch of the instantiated graph queues
    the recorded copies and host functions again, in order on the launching stream; freeing
    memory or recording an event while a stream captures is misuse."""
    out = _ok(_script("""
        HOST = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        calls = []
        fn = HOST(lambda arg: calls.append((arg, int(dev[0]))))
        cu.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, HOST, ctypes.c_void_p]
        cu.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        cu.fakecuda_launches.restype = cu.fakecuda_captures.restype = ctypes.c_uint64
        s, e = stream(), event()
        d = alloc(4096); dev = view(d, 4096)
        src = np.zeros(4096, np.uint8); assert cu.cuMemHostRegister_v2(src.ctypes.data, 4096, 1) == 0
        assert cu.cuStreamBeginCapture_v2(s, 1) == 0
        assert cu.cuMemcpyAsync(d, src.ctypes.data, 4096, s) == 0
        assert cu.cuLaunchHostFunc(s, fn, 7) == 0
        assert calls == [] and cu.fakecuda_executed() == 0     # recorded, not run
        g, x = ctypes.c_void_p(), ctypes.c_void_p()
        assert cu.cuStreamEndCapture(s, ctypes.byref(g)) == 0
        assert cu.cuGraphInstantiateWithFlags(ctypes.byref(x), g, ctypes.c_ulonglong(0)) == 0
        for k in (1, 2, 3):
            src[:] = k
            assert cu.cuGraphLaunch(x, s) == 0
            assert cu.cuEventRecord(e, s) == 0 and cu.cuEventSynchronize(e) == 0
        print("calls", calls)
        print("launches", cu.fakecuda_launches(), "captures", cu.fakecuda_captures(), "violations", cu.fakecuda_violations())
        assert cu.cuStreamBeginCapture_v2(s, 1) == 0
        assert cu.cuEventRecord(e, s) == 900                   # not while capturing
        assert cu.cuMemFree_v2(d) == 900
        assert cu.cuStreamEndCapture(s, ctypes.byref(g)) == 901 # the capture was broken
        print("after", cu.fakecuda_violations())
    """))
    assert "calls [(7, 1), (7, 2), (7, 3)]" in out, out  # each launch: the copy ran before the host function
    assert "launches 3 captures 1 violations 0" in out, out
    assert "after 2" in out, out


def test_a_higher_priority_stream_goes_first() -> None:
    """Work queued on a stream of the context's greatest priority runs before any queued on
    the others, whatever the random order across streams would pick; the range is 0..-1."""
    out = _ok(_script("""
        HOST = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        order = []
        fn = HOST(lambda arg: order.append(arg))
        cu.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, HOST, ctypes.c_void_p]
        least, greatest = ctypes.c_int(), ctypes.c_int()
        assert cu.cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)) == 0
        low, high = stream(), ctypes.c_void_p()
        assert cu.cuStreamCreateWithPriority(ctypes.byref(high), 1, greatest) == 0
        assert cu.cuStreamCreateWithPriority(ctypes.byref(ctypes.c_void_p()), 1, -7) == 1   # outside the range
        cu.fakecuda_pause(1)
        for k in range(20):
            assert cu.cuLaunchHostFunc(low, fn, 100 + k) == 0
            assert cu.cuLaunchHostFunc(high, fn, 200 + k) == 0
        cu.fakecuda_pause(0)
        assert cu.cuStreamSynchronize(low) == 0 and cu.cuStreamSynchronize(high) == 0
        print(least.value, greatest.value, order == [200 + k for k in range(20)] + [100 + k for k in range(20)])
    """))
    assert out.split() == ["0", "-1", "True"], out
