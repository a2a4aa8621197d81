"""CPU kernels run in a process per device (`backends/_devproc.py`): a real daemon, its real
device process, killed with SIGKILL; memory freed and allocated again under it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import transfer
from transfer import errors as E
from transfer.testing import DaemonProcess


def children(pid: int) -> set[int]:
    """The processes `pid` started (every thread's children)."""
    out: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.update(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
        except FileNotFoundError:
            pass
    return out


def device_processes(d: DaemonProcess) -> set[int]:
    found = set()
    for c in children(d.pid):
        try:
            if "transfer.kernels._process" in Path(f"/proc/{c}/cmdline").read_text():
                found.add(c)
        except FileNotFoundError:
            pass
    return found


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def wait_busy(d: DaemonProcess) -> int:
    """Until the CPU device's process is running what it was sent: it exists and its CPU time
    grows (three clock ticks past when this looked first). Its pid."""
    deadline = time.monotonic() + 60
    while not device_processes(d):
        assert time.monotonic() < deadline, "no device process started"
        time.sleep(0.005)
    (pid,) = device_processes(d)
    start = _cpu_ticks(pid)
    while _cpu_ticks(pid) < start + 3:
        assert time.monotonic() < deadline, "the device process never ran what it was sent"
        time.sleep(0.005)
    return pid


def scale_add(c: transfer.Client, seg: transfer.HostSegment, out: transfer.HostSegment, n: int, a: float) -> transfer.Pending:
    return c.compute("scale_add", [seg.tensor(n, np.float32)], [out.tensor(n, np.float32)], {"a": a, "b": 1.0})


def test_a_killed_device_process_fails_its_request_and_the_next_one_starts_again(daemon: DaemonProcess) -> None:
    """Killed while it runs a request: that request fails, saying so; the next one starts a
    new process, and the daemon serves on. (Killed while idle, it is only replaced.)"""
    n = 1 << 16
    x = np.arange(n, dtype=np.float32)
    m = 3072
    with transfer.connect(daemon.endpoint) as c, transfer.connect(daemon.endpoint) as bystander:
        assert device_processes(daemon) == set(), "started before any kernel ran"
        seg, out = c.segment(x.nbytes), c.segment(x.nbytes)
        seg.ndarray(n, np.float32)[:] = x
        scale_add(c, seg, out, n, 2.0).result()
        np.testing.assert_array_equal(out.ndarray(n, np.float32), 2 * x + 1)
        (first,) = device_processes(daemon)

        big = c.segment(3 * m * m * 4)
        running = c.compute("matmul", [big.tensor((m, m), np.float32), big.tensor((m, m), np.float32, offset=m * m * 4)],
                            [big.tensor((m, m), np.float32, offset=2 * m * m * 4)])
        assert wait_busy(daemon) == first  # the matmul runs in the process (it takes seconds on one core)
        os.kill(first, signal.SIGKILL)
        with pytest.raises(E.BackendError, match="killed by signal 9"):
            running.result()
        deadline = time.monotonic() + 10
        while first in children(daemon.pid) and Path(f"/proc/{first}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)

        # A new process, which maps the memory that existed before it (segments made before
        # the crash) and after it: the answers are right, for this session and another.
        late = c.segment(x.nbytes)
        scale_add(c, seg, late, n, 4.0).result()
        np.testing.assert_array_equal(late.ndarray(n, np.float32), 4 * x + 1)
        scale_add(c, seg, out, n, 3.0).result()
        np.testing.assert_array_equal(out.ndarray(n, np.float32), 3 * x + 1)
        (second,) = device_processes(daemon)
        assert second != first
        bs, bo = bystander.segment(16), bystander.segment(16)
        bs.ndarray(4, np.float32)[:] = 1
        scale_add(bystander, bs, bo, 4, 5.0).result()
        np.testing.assert_array_equal(bo.ndarray(4, np.float32), 6)
    code = daemon.stop()
    assert code == 0
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z" for p in (second,)):
        assert time.monotonic() < deadline, "the device process outlived its daemon"
        time.sleep(0.02)


def test_freed_memory_never_reaches_newer_memory(daemon: DaemonProcess) -> None:
    """Device buffers freed and allocated again, over and over: each compute sees exactly its
    own buffer's bytes (a device process maps by a key that is never reused)."""
    n = 4096
    with transfer.connect(daemon.endpoint) as c:
        seg, out = c.segment(n * 4), c.segment(n * 4)
        for k in range(20):
            seg.ndarray(n, np.float32)[:] = k
            buf = c.alloc(n * 4)
            c.copy(buf, seg).result()
            c.compute("scale_add", [buf.tensor(n, np.float32)], [out.tensor(n, np.float32)], {"a": 1.0, "b": 0.5}).result()
            np.testing.assert_array_equal(out.ndarray(n, np.float32), k + 0.5)
            c.free(buf)


def test_queued_passes_keep_their_order_around_work_the_daemon_does_itself(daemon: DaemonProcess) -> None:
    """Many in-place computes in flight from one session (they queue on the session's CPU
    pipeline, and the loop sends them ahead to the process), with a copy (which the daemon
    runs itself, on a worker) in the middle: every result is the sequential one."""
    n = 1 << 18  # 1 MiB of float32: more than the loop runs inline
    x0 = np.arange(n, dtype=np.float32)
    with transfer.connect(daemon.endpoint) as c:
        seg, snap = c.segment(x0.nbytes), c.segment(x0.nbytes)
        seg.ndarray(n, np.float32)[:] = x0
        t = seg.tensor(n, np.float32)
        for _ in range(3):
            pend = [c.compute("scale_add", [t], [t], {"a": 1.0, "b": 1.0}) for _ in range(12)]
            pend.append(c.copy(snap, seg))
            pend += [c.compute("scale_add", [t], [t], {"a": 1.0, "b": 1.0}) for _ in range(12)]
            for p in pend:
                p.result()
            x0 = x0 + 12
            np.testing.assert_array_equal(snap.ndarray(n, np.float32), x0)
            x0 = x0 + 12
            np.testing.assert_array_equal(seg.ndarray(n, np.float32), x0)


def test_the_loop_never_waits_behind_a_busy_device_process(daemon: DaemonProcess) -> None:
    """Session A keeps the CPU device's process busy with a long matmul; session B sends a
    compute small enough for the loop to have run it in place. B's compute waits behind A's in
    the process, but the loop only sent it: session C's copy is answered while A's matmul
    still runs."""
    n = 3072
    with (transfer.connect(daemon.endpoint) as a, transfer.connect(daemon.endpoint) as b,
          transfer.connect(daemon.endpoint) as c):
        m = a.segment(3 * n * n * 4)
        m.ndarray((2, n, n), np.float32)[:] = 1
        big = a.compute("matmul", [m.tensor((n, n), np.float32), m.tensor((n, n), np.float32, offset=n * n * 4)],
                        [m.tensor((n, n), np.float32, offset=2 * n * n * 4)])
        wait_busy(daemon)  # A's matmul runs in the process (it takes seconds on one core)
        bs, bo = b.segment(256), b.segment(256)
        small = scale_add(b, bs, bo, 64, 2.0)
        cs, co = c.segment(64), c.segment(64)
        c.copy(co, cs).result()
        # Answered while the matmul runs: had the loop waited for B's compute, it would have
        # answered the copy only once the matmul (ahead of B's in the process) had ended.
        with pytest.raises(E.RequestTimeout):
            big.result(timeout=0.05)
        big.result()
        small.result()
        np.testing.assert_array_equal(m.ndarray((n, n), np.float32, offset=2 * n * n * 4)[:2, :2], n)


def test_many_virtual_cpu_devices_share_one_process_per_core() -> None:
    """--devices allows 1024: they share at most one process per core, and each computes."""
    from transfer.addressing import SegmentKind
    from transfer.backends import NumpyBackend, Span
    from transfer.kernels import REGISTRY, TensorRef

    backend = NumpyBackend(64)
    try:
        assert len(backend.procs) <= (os.cpu_count() or 1)
        mem = backend.alloc(64 * 4 * 2, 0)
        x = np.frombuffer(mem, np.float32)
        x[:] = np.arange(128)
        kernel = REGISTRY.get("scale_add", ("float32", "float32"), "cpu")
        t = TensorRef(1, "float32", (64,))
        for device in (0, 17, 63):
            backend.compute(kernel, [(t, Span(SegmentKind.DEVICE, mem, 0, 256))], [(t, Span(SegmentKind.DEVICE, mem, 256, 256))],
                            {"a": float(device), "b": 1.0}, device)
            np.testing.assert_array_equal(x[64:], np.arange(64, dtype=np.float32) * device + 1)
        assert sum(p.starts for p in backend.procs) <= len(backend.procs)
    finally:
        backend.close()


def _kernel_and_tensor(n: int) -> tuple[Any, Any]:
    from transfer.kernels import REGISTRY, TensorRef

    return REGISTRY.get("scale_add", ("float32", "float32"), "cpu"), TensorRef(1, "float32", (n,))


def test_a_sender_that_must_not_wait_is_refused_whole_and_nothing_is_lost() -> None:
    """The event loop sends runs with block=False. With the device process stopped (SIGSTOP)
    its socket fills: the send that would block raises BlockingIOError having sent nothing,
    a map queued meanwhile waits too, and once the process runs again every run sent is
    answered, in order, exactly once (each adds 1 in place: the sum counts them)."""
    from transfer.addressing import SegmentKind
    from transfer.backends import NumpyBackend, Span

    kernel, t = _kernel_and_tensor(16)
    backend = NumpyBackend(1)
    proc = backend.procs[0]
    try:
        mem = backend.alloc(64, 0)
        x = np.frombuffer(mem, np.float32)
        span = [(t, Span(SegmentKind.DEVICE, mem, 0, 64))]
        with pytest.raises(BlockingIOError):  # not started: starting it is a thread's job
            backend.begin_compute(kernel, span, span, {"a": 1.0, "b": 1.0}, 0, block=False)
        backend.compute(kernel, span, span, {"a": 1.0, "b": 1.0}, 0)  # starts it
        pid = proc.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            answers = []
            for _ in range(100_000):
                try:
                    answers.append(backend.begin_compute(kernel, span, span, {"a": 1.0, "b": 1.0}, 0, block=False))
                except BlockingIOError:
                    break
            else:
                pytest.fail("the stopped process's socket never filled")
            assert len(answers) > 10
            later = backend.alloc(64, 0)  # its map is queued behind the full socket
            with pytest.raises(BlockingIOError):
                backend.begin_compute(kernel, span, span, {"a": 1.0, "b": 1.0}, 0, block=False)
            assert proc.pending
        finally:
            os.kill(pid, signal.SIGCONT)
        y = np.frombuffer(later, np.float32)
        backend.compute(kernel, span, [(t, Span(SegmentKind.DEVICE, later, 0, 64))], {"a": 2.0, "b": 0.0}, 0)
        for answer in answers:
            assert answer() is None
        np.testing.assert_array_equal(x, 1 + len(answers))
        np.testing.assert_array_equal(y, 2 * (1 + len(answers)))
    finally:
        backend.close()


def test_an_answer_tells_once_whether_asked_before_or_after_and_raises_its_error() -> None:
    from transfer.backends import Answer

    told: list[str] = []
    a = Answer()
    a.on_done(lambda: told.append("before"))
    doubled = a.then(lambda v: v * 2)
    assert told == []
    a.set(21)
    a.on_done(lambda: told.append("after"))
    assert told == ["before", "after"] and a() == 21 and doubled() == 42
    failed = Answer()
    failed.then(lambda v: v).on_done(lambda: told.append("failed"))
    failed.set(error=E.BackendError("gone"))
    with pytest.raises(E.BackendError, match="gone"):
        failed.then(lambda v: v)()
    assert told[-1] == "failed"


def test_a_pass_the_process_takes_in_part_is_finished_in_order() -> None:
    """`Sent.send(False)` stops at the op the process cannot take now; `send(True)` (a
    thread's) sends the rest in order; the pass is done when its last op is answered."""
    from transfer.backends import Answer
    from transfer.server._ops import Op
    from transfer.server._pipeline import Sent

    order: list[tuple[int, bool]] = []
    answers = [Answer() for _ in range(3)]
    refused = {1}

    def op(i: int) -> Op:
        def begin(block: bool) -> Answer:
            if not block and i in refused:
                refused.discard(i)
                raise BlockingIOError
            order.append((i, block))
            return answers[i]

        return Op(i + 1, [], [], None, 0, begin=begin)  # type: ignore[arg-type]

    # An op that cannot be sent at all (here: the last) is answered with its error at once;
    # the pass is still done only when the ops before it are.
    broken = Op(9, [], [], None, 0, begin=lambda block: (_ for _ in ()).throw(E.InvalidField("too large")))  # type: ignore[arg-type]
    alone = Sent([op(0), broken])
    answers[0] = Answer()
    assert alone.send(False) and isinstance(broken.error, E.InvalidField)
    early: list[int] = []
    alone.on_done(lambda: early.append(1))
    assert early == [], "told done while an op before the broken one still runs"
    answers[0].set("x")
    assert early == [1]
    order.clear()
    answers[0] = Answer()
    ops = [op(i) for i in range(3)]
    sent = Sent(ops)
    assert not sent.send(False) and order == [(0, False)] and not sent.sent_all
    assert sent.send(True) and order == [(0, False), (1, True), (2, True)] and sent.sent_all
    told: list[int] = []
    sent.on_done(lambda: told.append(1))
    answers[0].set("a")
    answers[1].set(error=E.BackendError("boom"))
    assert told == []
    answers[2].set("c")
    assert told == [1]
    sent.end()
    assert [o.result for o in ops] == ["a", None, "c"]
    assert ops[0].error is None and isinstance(ops[1].error, E.BackendError) and ops[2].error is None


def test_memory_made_and_freed_between_runs_holds_no_fds() -> None:
    """Segments made and freed while no run is sent (a client's churn) do not pile up as
    unsent maps holding fds until the next run: a map never sent is dropped with its fd."""
    from transfer.addressing import SegmentKind
    from transfer.backends import NumpyBackend, Span

    kernel, t = _kernel_and_tensor(16)
    backend = NumpyBackend(1)
    proc = backend.procs[0]
    try:
        mem = backend.alloc(64, 0)
        span = [(t, Span(SegmentKind.DEVICE, mem, 0, 64))]
        backend.compute(kernel, span, span, {"a": 1.0, "b": 1.0}, 0)  # the process runs
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(200):
            backend.free(backend.alloc(4096, 0))
        assert len(proc.pending) == 0 and len(os.listdir("/proc/self/fd")) <= fds
        backend.compute(kernel, span, span, {"a": 1.0, "b": 1.0}, 0)  # and still computes
        np.testing.assert_array_equal(np.frombuffer(mem, np.float32), 2.0)
    finally:
        backend.close()


def test_a_daemon_stopped_while_its_device_process_computes_exits_cleanly(daemon_factory: Any, capfd: Any) -> None:
    """SIGTERM with a matmul of seconds running in the CPU device's process and more queued
    behind it, past a short grace: the loop that read the process's answers is cancelled, a
    thread reads them from then on, and the daemon still exits 0, its process with it (a
    reader that stopped with answers owed would leave the shielded completer waiting forever)."""
    d = daemon_factory("--shutdown-grace", "0.1")
    m = 3072
    with transfer.connect(d.endpoint) as c:
        seg, out = c.segment(1 << 16), c.segment(1 << 16)
        scale_add(c, seg, out, 64, 2.0).result()  # the process is running
        (proc,) = device_processes(d)
        big = c.segment(3 * m * m * 4)
        running = c.compute("matmul", [big.tensor((m, m), np.float32), big.tensor((m, m), np.float32, offset=m * m * 4)],
                            [big.tensor((m, m), np.float32, offset=2 * m * m * 4)])
        behind = [scale_add(c, seg, out, 64, 3.0) for _ in range(8)]
        assert wait_busy(d) == proc  # the matmul runs in the process
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        for p in [running, *behind]:  # each answered: done, or cut off by the shutdown
            try:
                p.result(timeout=10)
            except transfer.TransferError:
                pass
    assert "not read to their end" not in capfd.readouterr().err
    deadline = time.monotonic() + 5
    while Path(f"/proc/{proc}").exists() and Path(f"/proc/{proc}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the device process outlived its daemon"
        time.sleep(0.02)


def test_the_inline_rule_never_runs_a_device_process_s_kernels_on_the_loop() -> None:
    """The loop reads the device processes' answers, so it must never run their kernels itself
    (it would wait for itself): a compute there is never inline, with `begin` or without (one
    whose remote inputs are pulled first runs whole). A copy on that device runs in the daemon,
    so a small one stays on the loop (taking it off cost the socket round trip ~1.7x)."""
    from types import SimpleNamespace

    from transfer.server._ops import Op, runs_inline

    cpu = SimpleNamespace(backend=SimpleNamespace(out_of_process=True))
    gpu = SimpleNamespace(backend=SimpleNamespace(out_of_process=False))

    def op(device: Any, kind: str, begin: Any = None) -> Op:
        o = Op(1, [], [(1, 0, 64)], device, 64, lambda: None, begin=begin)  # (each writes: a read-only op counts half)
        o.kind = kind
        return o

    assert runs_inline([op(cpu, "copy")], 1 << 16)
    assert not runs_inline([op(cpu, "compute")], 1 << 16)  # (after its pulls: no begin)
    assert not runs_inline([op(cpu, "compute", begin=lambda block: None)], 1 << 16)
    assert runs_inline([op(gpu, "compute")], 1 << 16)
    assert not runs_inline([op(cpu, "copy")], 32)  # over inline_bytes
    # An op that writes nothing (a checksum, a verified remote copy's sums, whatever its kind)
    # only reads its bytes: they count half.
    assert runs_inline([Op(1, [(1, 0, 64)], [], gpu, 64, lambda: None)], 32)
