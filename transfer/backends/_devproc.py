"""A CPU device as a process of its own: its kernels run beside the daemon's event loop, not
under the loop's GIL.

Why: a CPU kernel is NumPy calls with Python between them. On a worker thread of the
daemon's interpreter, every one of those Python steps waits for the GIL while the loop
receives, plans and answers, and the loop waits for the worker's. The MLP of issue 18 ran
at 0.70x the same math in-process that way, and at 0.93-0.97x with its kernels in a process
of their own (`bench/compute_process.py`).

**Memory.** Every byte a kernel may touch is a memfd the daemon made: host segments
(`ShmFile`) and the CPU backend's own allocations (device buffers, graph intermediates,
staging for remote inputs). `SharedIndex` keeps each one's fd while the memory lives and
names it by a key that is never reused. A device process maps a memory (the fd travels
with SCM_RIGHTS) before any request that names it, and unmaps it when it is freed. A
request that names memory freed since it was planned fails ("freed"): a key can never
reach newer memory.

**Protocol.** One SOCK_SEQPACKET socketpair per process; each message is one pickle (both
ends are this module: nothing else can write to the pair). To the process: ``("map", key,
nbytes)`` with one fd, ``("unmap", key)``, ``("run", steps, failed)``. It answers each run
with the outcomes of `kernels.run_steps`. Only a caller holding the process's lock writes to
the socket; the event loop only queues maps and unmaps (`SharedIndex.add` / `remove`), so it
never blocks on a busy process.

**Failure.** A process that dies (a crash, the OOM killer, kill -9) fails the run in flight
with `BackendError`, naming how it ended; the next run starts a new process, which maps
every live memory again. The daemon serves on.
"""

from __future__ import annotations

import collections
import itertools
import os
import pickle
import socket
import subprocess
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .. import errors as E
from ..addressing import SegmentKind
from ..kernels import MAX_MESSAGE, process_argv

__all__ = ["SharedIndex", "DeviceProcess"]

_keys = itertools.count(1)
HOST = SegmentKind.HOST


class SharedIndex:
    """The memory device processes may map: id(base array) -> (key, fd, nbytes, base).

    Keyed by the id of the array a span's memory resolves to (a `ShmFile`'s `.array`, a
    device buffer itself); the entry holds the array, so no live object shares its id."""

    def __init__(self) -> None:
        self.by_id: dict[int, tuple[int, int, int, Any]] = {}
        self.procs: list[DeviceProcess] = []
        self.lock = threading.Lock()  # entries and the processes' queues change together

    def add(self, base: np.ndarray, fd: int, nbytes: int) -> None:
        """Make `base` (a mapping of the memfd `fd`, which this index now owns) mappable."""
        with self.lock:
            key = next(_keys)
            self.by_id[id(base)] = (key, fd, nbytes, base)
            for proc in self.procs:
                proc.queue_map(key, fd, nbytes)

    def remove(self, base: Any) -> None:
        with self.lock:
            entry = self.by_id.pop(id(base), None)
            if entry is None:
                return
            key, fd, _, _ = entry
            os.close(fd)
            for proc in self.procs:
                proc.queue_unmap(key)

    def key(self, base: Any) -> int:
        entry = self.by_id.get(id(base))
        if entry is None:
            raise E.SegmentFreed("the memory was freed while the request ran")
        return entry[0]

    def close(self) -> None:
        with self.lock:
            for key, fd, _, _ in self.by_id.values():
                os.close(fd)
            self.by_id.clear()


class DeviceProcess:
    """One CPU device's process: started at its first run, started again after a crash.

    A run is sent (`begin`) and its answer waited for later (the function `begin` returns),
    so a caller may queue the next run while this one computes: the process then goes from
    one to the next without waiting for the daemon's Python in between. It runs them in
    the order they were sent, and answers in that order."""

    def __init__(self, shared: SharedIndex, device: int) -> None:
        self.shared, self.device = shared, device
        #: Maps (with their own fd: a dup, closed once sent) and unmaps not yet sent, in order.
        self.pending: collections.deque[tuple[str, int, int, int]] = collections.deque()
        self._sock: socket.socket | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()  # the process's state, and sending
        self._reading = threading.Lock()  # one reader of answers at a time
        #: Which process this is (a run waits only for the process it was sent to), runs sent
        #: to it and answers read from it; answers read for runs another caller waits for.
        self._gen = 0
        self._sent = self._read = 0
        self._answers: dict[tuple[int, int], bytes] = {}
        self._buf = bytearray(MAX_MESSAGE)  # what answers are read into (one reader at a time)
        self._ended: dict[int, str] = {}
        self.starts = 0

    def queue_map(self, key: int, fd: int, nbytes: int) -> None:
        """(Under the index's lock.) Map this memory before the next run, if running."""
        if self._sock is not None:
            self.pending.append(("map", key, os.dup(fd), nbytes))

    def queue_unmap(self, key: int) -> None:
        """(Under the index's lock.) Unmap this memory before the next run, if running (a
        process started later never maps it)."""
        if self._sock is not None:
            self.pending.append(("unmap", key, -1, 0))

    def begin(self, steps: Sequence[Any], failed: set[int]) -> Callable[[], list[tuple[int, Any, float]]]:
        """Send `steps` (kernels over (TensorRef, Span) operands) to the process; returns what
        waits for their outcomes."""
        key = self.shared.key

        def operands(pairs: Any) -> list[tuple[Any, ...]]:
            return [(key(s.mem.array if s.kind is HOST else s.mem), s.offset, t.shape, t.dtype, t.strides) for t, s in pairs]

        wire = [(i, (kernel.op, kernel.sig, kernel.device_kind), operands(ins), operands(outs), params, deps, name)
                for i, kernel, ins, outs, params, deps, name in steps]
        msg = pickle.dumps(("run", wire, failed), 5)
        if len(msg) > MAX_MESSAGE:
            raise E.InvalidField(f"a run of {len(steps)} kernels is too large for the CPU device ({len(msg)} bytes)")
        with self._lock:
            if self._sock is None:
                self._start()
            sock, gen, seq = self._sock, self._gen, self._sent
            assert sock is not None
            self._sent += 1
            try:
                self._flush(sock)
                sock.send(msg)
            except OSError:
                pass  # the process is gone: reading says how
        return lambda: self._wait(gen, seq)

    def _wait(self, gen: int, seq: int) -> list[tuple[int, Any, float]]:
        with self._reading:
            while True:
                answer = self._answers.pop((gen, seq), None)
                if answer is not None:
                    outcomes: list[tuple[int, Any, float]] = pickle.loads(answer)
                    return outcomes
                if gen != self._gen:
                    raise E.BackendError(self._ended[gen])
                sock = self._sock
                try:
                    n = sock.recv_into(self._buf) if sock is not None else 0  # (without the GIL)
                except OSError:
                    n = 0
                if not n:
                    self._died()
                    continue
                self._answers[(self._gen, self._read)] = bytes(self._buf[:n])
                self._read += 1

    def _flush(self, sock: socket.socket) -> None:
        pending = self.pending
        while pending:
            kind, key, fd, nbytes = pending.popleft()
            if kind == "map":
                try:
                    socket.send_fds(sock, [pickle.dumps(("map", key, nbytes))], [fd])
                finally:
                    os.close(fd)
            else:
                sock.send(pickle.dumps(("unmap", key)))

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, MAX_MESSAGE)
        try:
            child = subprocess.Popen(process_argv(theirs.fileno()), pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as exc:
            ours.close()
            raise E.BackendError(f"cannot start the CPU device {self.device} process: {exc}") from None
        finally:
            theirs.close()
        with self.shared.lock:  # every live memory, then whatever comes after, in order
            self.pending.clear()
            self._sock, self._child = ours, child
            self._sent = self._read = 0
            for key, fd, nbytes, _ in self.shared.by_id.values():
                self.queue_map(key, fd, nbytes)
            if self not in self.shared.procs:
                self.shared.procs.append(self)
        self.starts += 1

    def _died(self) -> None:
        """(Reading.) The process is gone: reap it, and fail every run sent to it, saying how
        it ended. The next run starts a new one."""
        with self._lock:
            sock, child = self._sock, self._child
            with self.shared.lock:
                self._sock = self._child = None
                self._drop_pending()
            how = "is gone"
            if child is not None:
                code = _reap(child)
                how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            if sock is not None:
                sock.close()
            self._ended[self._gen] = (f"the CPU device {self.device} process {how} while running this request; "
                                      f"the next request starts a new one")
            self._gen += 1

    def _drop_pending(self) -> None:
        for kind, _, fd, _ in self.pending:
            if kind == "map":
                os.close(fd)
        self.pending.clear()

    def close(self) -> None:
        with self._lock:
            sock, child = self._sock, self._child
            self._sock = self._child = None
            if sock is not None:
                sock.close()  # the process reads EOF and exits
            if child is not None:
                _reap(child)
            self._drop_pending()


def _reap(child: subprocess.Popen[bytes]) -> int:
    """Wait for a device process that is ending (its socket closed, or it died); kill it
    after 5 s (a kernel still running). Its exit status."""
    try:
        return child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()
