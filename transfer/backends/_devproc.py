"""A CPU device as a process of its own: its kernels run beside the daemon's event loop, not
under the loop's GIL.

Why: a CPU kernel is NumPy calls with Python between them. On a worker thread of the
daemon's interpreter, every one of those Python steps waits for the GIL while the loop
receives, plans and answers, and the loop waits for the worker's. An MLP graph ran
at 0.70x the same math in-process that way, and at 0.93-0.97x with its kernels in a process
of their own.

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
with the outcomes of `kernels.run_steps`, in order; whoever reads the process's `Channel`
hands each answer to its `Answer`. Only a caller holding the process's lock writes to the
socket. The event loop never blocks on a busy process: it queues maps and unmaps
(`SharedIndex.add` / `remove`), sends runs only without waiting (`begin(block=False)`, else
a worker sends them), and is told of answers (`Answer.on_done`).

**Reading answers.** A daemon's event loop reads them itself (`DeviceProcess.adopt`: it
waits for the socket to be readable, then reads what is there without waiting), so an
answer costs no thread hop: a reader thread per process woke the loop through a wakeup
socket and traded the GIL with it on every answer (a small compute's p50 went from 662
to 601 us without it). Without a loop (a benchmark driving the backend, a loop that has
ended), a thread reads: the same `Channel.read`, blocking.

**Failure.** A process that dies (a crash, the OOM killer, kill -9) fails the run in flight
with `BackendError`, naming how it ended; the next run starts a new process, which maps
every live memory again. The daemon serves on.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import pickle
import select
import socket
import subprocess
import threading
from typing import Any, Callable, Sequence

import numpy as np

from .. import errors as E
from ..addressing import SegmentKind
from ..kernels import MAX_MESSAGE, process_argv
from ._base import Answer

__all__ = ["Channel", "DeviceProcess", "SharedIndex"]

log = logging.getLogger("transfer.backends")
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


class Channel:
    """One started process's answers: its socket, and the `Answer` of each run sent to it,
    in order. One reader at a time reads it: the event loop that adopted it (`read(False)`
    whenever the socket is readable), or a thread (`pump`). At the end of the stream
    (`read` gives False), `end` fails what is still owed, saying how the process ended."""

    def __init__(self, proc: "DeviceProcess", sock: socket.socket, child: subprocess.Popen[bytes]) -> None:
        self.proc, self.sock, self.child = proc, sock, child
        #: The answers the process owes, in the order the runs were sent.
        self.owed: collections.deque[Answer] = collections.deque()
        self.ended = threading.Event()
        self.thread: threading.Thread | None = None
        self._buf = bytearray(MAX_MESSAGE)  # (reused: a fresh 1 MiB buffer per answer costs ~50 us)

    def read(self, block: bool) -> bool:
        """Hand each answer that is in to its run's `Answer`: with `block`, wait for one (in
        recv, without the GIL); else read what is there and return. False once the stream
        has ended (the process exited or was closed): then call `end`."""
        buf, flags = self._buf, 0 if block else socket.MSG_DONTWAIT
        while True:
            try:
                n = self.sock.recv_into(buf, 0, flags)
            except BlockingIOError:
                return True
            except OSError:
                n = 0
            if not n:
                return False
            answer = self.owed.popleft()
            try:
                outcomes = pickle.loads(memoryview(buf)[:n])
            except Exception as exc:  # (cannot happen: the other end is ours) fail this run alone
                answer.set(error=E.BackendError(f"the CPU device {self.proc.device} process sent an unreadable answer: {exc!r}"))
            else:
                try:
                    answer.set(outcomes)
                except Exception:  # a caller's callback: its bug, not the device's; read on
                    log.exception("a callback on a CPU device answer failed")
            if block:
                return True

    def pump(self) -> None:
        """A thread reads the answers from now on (no loop adopted them, or it has ended)."""
        self.thread = threading.Thread(target=self._pump, daemon=True, name=f"transfer-cpu{self.proc.device}-answers")
        self.thread.start()

    def _pump(self) -> None:
        while self.read(True):
            pass
        self.end()

    def end(self) -> None:
        """(The stream has ended: may wait up to 5 s for the process to exit.) Fail what is
        still owed, saying how the process ended; the next run starts a new one."""
        proc = self.proc
        if proc._detach(self) is not None:  # else `close` ended it
            code = _reap(self.child)
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            why = (f"the CPU device {proc.device} process {how} while running this request; "
                   f"the next request starts a new one")
        else:
            why = f"the CPU device {proc.device} process was closed before this request ran"
        self.sock.close()
        owed = self.owed
        while owed:
            owed.popleft().set(error=E.BackendError(why))
        self.ended.set()


class DeviceProcess:
    """One CPU device's process: started at its first run, started again after a crash.

    A run is sent (`begin`) and answered later (the `Answer` it returns), so a caller may
    queue the next run while this one computes: the process then goes from one to the next
    without waiting for the daemon's Python in between. It runs them in the order they were
    sent, and answers in that order, on its `Channel`: whoever reads it hands each answer to
    its `Answer`, so a worker thread blocked on it wakes, and the event loop is told
    (`Answer.on_done`). `adopt` sets who reads a new process's channel (a daemon's loop)."""

    def __init__(self, shared: SharedIndex, device: int) -> None:
        self.shared, self.device = shared, device
        #: Maps (with their own fd: a dup, closed once sent) and unmaps not yet sent, in order.
        self.pending: collections.deque[tuple[str, int, int, int]] = collections.deque()
        self._channel: Channel | None = None
        self._lock = threading.Lock()  # the process's state, and sending
        self.starts = 0
        #: Takes over reading a new process's channel (True), else a thread reads it.
        self.adopt: Callable[[Channel], bool] | None = None

    @property
    def pid(self) -> int | None:
        channel = self._channel
        return channel.child.pid if channel is not None else None

    def queue_map(self, key: int, fd: int, nbytes: int) -> None:
        """(Under the index's lock.) Map this memory before the next run, if running."""
        if self._channel is not None:
            self.pending.append(("map", key, os.dup(fd), nbytes))

    def queue_unmap(self, key: int) -> None:
        """(Under the index's lock.) Unmap this memory before the next run, if running (a
        process started later never maps it). A map of it not sent yet is dropped instead,
        its fd closed now: memory made and freed between runs (a client's churn) must not
        hold fds until the next run. Only when no sender holds the process (never waits)."""
        if self._channel is None:
            return
        if self._lock.acquire(False):  # (no _flush runs meanwhile: pending may be edited)
            try:
                for i, (kind, k, fd, _) in enumerate(self.pending):
                    if kind == "map" and k == key:
                        del self.pending[i]
                        os.close(fd)
                        return  # never sent: the process has nothing to unmap
            finally:
                self._lock.release()
        self.pending.append(("unmap", key, -1, 0))

    def begin(self, steps: Sequence[Any], failed: set[int], block: bool = True) -> Answer:
        """Send `steps` (kernels over (TensorRef, Span) operands) to the process; the answer
        is their outcomes. With `block` False (the event loop) this never waits: it raises
        BlockingIOError, having sent nothing, if the process must be started, another thread
        is sending, or the socket is full; a worker thread may then send it."""
        key = self.shared.key

        def operands(pairs: Any) -> list[tuple[Any, ...]]:
            return [(key(s.mem.array if s.kind is HOST else s.mem), s.offset, t.shape, t.dtype, t.strides) for t, s in pairs]

        wire = [(i, (kernel.op, kernel.sig, kernel.device_kind), operands(ins), operands(outs), params, deps, name)
                for i, kernel, ins, outs, params, deps, name in steps]
        msg = pickle.dumps(("run", wire, failed), 5)
        if len(msg) > MAX_MESSAGE:
            raise E.InvalidField(f"a run of {len(steps)} kernels is too large for the CPU device ({len(msg)} bytes)")
        if not self._lock.acquire(block):
            raise BlockingIOError("another thread is sending to the CPU device process")
        try:
            channel = self._channel
            if channel is None:
                if not block:
                    raise BlockingIOError("the CPU device process is not running")
                channel = self._start()
            sock = channel.sock
            flags = 0 if block else socket.MSG_DONTWAIT
            answer = Answer()
            channel.owed.append(answer)  # (before the send: its answer may come at once)
            try:
                self._flush(sock, flags)
                sock.send(msg, flags)
            except BlockingIOError:
                channel.owed.pop()  # not sent: nothing will answer it
                raise
            except OSError:
                pass  # the process is gone: its reader fails what it owed, saying how
            return answer
        finally:
            self._lock.release()

    def _flush(self, sock: socket.socket, flags: int) -> None:
        pending = self.pending
        while pending:
            kind, key, fd, nbytes = pending[0]
            if kind == "map":
                if flags and not _writable(sock):
                    # (A sendmsg carrying fds blocks on a full socket even with MSG_DONTWAIT,
                    # on Linux 6.18: so it is sent only when the socket says it has room.)
                    raise BlockingIOError("the CPU device process's socket is full")
                socket.send_fds(sock, [pickle.dumps(("map", key, nbytes))], [fd], flags)
                os.close(fd)
            else:
                sock.send(pickle.dumps(("unmap", key)), flags)
            pending.popleft()  # (sent: a send that would block leaves it queued)

    def _start(self) -> Channel:
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
        channel = Channel(self, ours, child)
        with self.shared.lock:  # every live memory, then whatever comes after, in order
            self.pending.clear()
            self._channel = channel
            for key, fd, nbytes, _ in self.shared.by_id.values():
                self.queue_map(key, fd, nbytes)
            if self not in self.shared.procs:
                self.shared.procs.append(self)
        adopt = self.adopt
        if adopt is None or not adopt(channel):
            channel.pump()
        self.starts += 1
        return channel

    def _detach(self, channel: Channel | None = None) -> Channel | None:
        """Forget the running process's channel (only if it is `channel`, where given) with
        the maps and unmaps queued for it; the channel forgotten, else None. What `close`
        and a channel's `end` share: whichever comes first ends the process's state."""
        with self._lock:
            current = self._channel
            if current is None or (channel is not None and current is not channel):
                return None
            with self.shared.lock:
                self._channel = None
                self._drop_pending()
            return current

    def _drop_pending(self) -> None:
        for kind, _, fd, _ in self.pending:
            if kind == "map":
                os.close(fd)
        self.pending.clear()

    def close(self) -> None:
        """End the process; what it still owed fails. (Not on the loop that reads it: this
        waits for its reader to end, up to 5 s.)"""
        channel = self._detach()
        if channel is None:
            return
        try:
            channel.sock.shutdown(socket.SHUT_RDWR)  # the process reads EOF and exits; the reader wakes
        except OSError:
            pass  # (the process is gone already: the reader has woken)
        _reap(channel.child)
        if channel.thread is not threading.current_thread() and not channel.ended.wait(5):
            log.warning("the CPU device %d process's answers were not read to their end: %d still owed",
                        self.device, len(channel.owed))


def _writable(sock: socket.socket) -> bool:
    poll = select.poll()  # (not select.select: a daemon's fds pass FD_SETSIZE)
    poll.register(sock, select.POLLOUT)
    return bool(poll.poll(0))


def _reap(child: subprocess.Popen[bytes]) -> int:
    """Wait for a device process that is ending (its socket closed, or it died); kill it
    after 5 s (a kernel still running). Its exit status."""
    try:
        return child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()
