"""The blocking client, for processes without an event loop (DataLoader workers).

I/O happens in the caller's thread while it waits: `Pending.result()` and
`fence()` poll the socket until their reply is in. A small heartbeat thread
pings while the caller is idle, so the daemon keeps an idle session. While
waiting, the client watches the daemon's pid (same host) and the silence on
the socket, so a dead daemon is an error within bounded time, never a hang.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Any, Sequence, TypeVar

import zmq

from .. import _results as R
from .. import errors as E
from .. import protocol as P
from ..transport._fds import daemon_pidfd
from ..transport._zmq import ipc_path, resolve_endpoint
from .._pending import Pending
from ..ring import RingLink
from ._naps import Naps
from ._resources import Addressable
from ._deferred import Graph
from ._session import Op, Session
from ._socket import open_socket

T = TypeVar("T")

__all__ = ["Client", "connect"]


class Client(Session):
    """A session with a transfer daemon. Use as a context manager."""

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        name: str = "",
        connect_timeout: float = 5.0,
        liveness_timeout: float = 10.0,
        max_inflight: int = 1 << 16,
        watch_daemon_pid: bool = True,
        server_key: Any = None,
        client_keys: Any = None,
        deferred: bool = True,
        ring: bool | int | None = None,
        priority: str = "normal",
    ) -> None:
        """`server_key` pins the daemon's CURVE public key (z85 or a key file) for tcp://;
        `client_keys` is this client's pair (a ``NAME.key_secret`` file or (public, secret)).
        `ring`: the shared-memory request ring copies, fills, checksums and fences take
        instead of the socket (docs/ring.md). Default: on for a same-host (ipc) daemon, off
        for tcp; False opts out; an int is its capacity (default 1024). `priority`:
        "latency" for a latency-sensitive tenant: its device streams get the device's
        greatest priority (docs/operations.md, "Sharing a GPU"); default "normal"."""
        super().__init__(resolve_endpoint(endpoint), Pending, self._wait_for)
        self._liveness_timeout = liveness_timeout
        self._core.max_inflight = max(1, max_inflight)
        self._closed = False
        self._daemon_pidfd = -1
        self._sock = open_socket(self.endpoint, server_key, client_keys, connect_timeout)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._last_rx = self._last_tx = time.monotonic()
        self._naps = Naps()
        try:
            try:
                self._run(self._op_hello(name, deferred, priority), connect_timeout)
            except E.RequestTimeout:
                raise E.DaemonUnavailable(f"no daemon answered at {self.endpoint} within {connect_timeout}s") from None
        except BaseException:
            self._sock.close(0)
            raise
        if ipc_path(self.endpoint) is not None and watch_daemon_pid:
            with contextlib.suppress(OSError):
                self._daemon_pidfd = daemon_pidfd(self._core.fd_socket, self.server_pid)
                self._poller.register(self._daemon_pidfd, zmq.POLLIN)
        if ring is not False:
            try:
                self._start_ring(ring)
            except BaseException:
                self.close()
                raise
        self._stop_heartbeat = threading.Event()
        self._hb_thread = threading.Thread(target=self._heartbeat, name="transfer-heartbeat", daemon=True)
        self._hb_thread.start()

    # --- context management -----------------------------------------------------------
    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the session: the daemon releases everything it holds for us."""
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_stop_heartbeat"):
            self._stop_heartbeat.set()
        with self._lock:
            try:
                self._run(self._op_close(), min(5.0, self._liveness_timeout))
            except E.TransferError:
                pass
            finally:
                self._sock.close(0)
                if self._daemon_pidfd >= 0:
                    os.close(self._daemon_pidfd)
                    self._daemon_pidfd = -1
                self._core.release()

    def poll(self) -> int:
        """Take in whatever replies have arrived, without waiting; return how many requests are still pending.

        The socket is read only when a reply is owed there (a request it carried, or a ring
        failure's message): a look at an empty zmq socket costs more than reaping the ring,
        and the heartbeat thread takes in what the daemon sends unasked."""
        with self._lock:
            core = self._core
            core.check_usable()
            core.reap_ring()
            if core.socket_owed():
                self._recv_all()
            return len(core.pending)

    # --- how this client waits: in the caller's thread ------------------------------------
    def _run(self, op: Op[T], timeout: float | None = None) -> T:
        """Run an operation to its end here, waiting for each request it yields."""
        deadline = None if timeout is None else time.monotonic() + timeout
        failed: BaseException | None = None
        while True:
            try:
                p = op.throw(failed) if failed is not None else op.send(None)
            except StopIteration as stop:
                result: T = stop.value
                return result
            failed = None
            try:
                self._wait_for(p, None if deadline is None else max(0.0, deadline - time.monotonic()))
            except BaseException as exc:  # thrown in: the operation may clean up (and re-raises)
                failed = exc

    def _link(self, info: R.RingOpened | R.ChannelOpened) -> RingLink:
        return self._map(info)

    def run_graph(self, graph: Graph, inputs: Sequence[Addressable], outputs: Sequence[Addressable], *,
                  profile: bool = False, stream: int = 0) -> Any:
        p = super().run_graph(graph, inputs, outputs, profile=profile, stream=stream)
        if self._core.ring is not None:  # (its wait naps once the graph's waits are known: `_naps`)
            self._naps.ran(p.id, graph.va)
        return p

    run_graph.__doc__ = Session.run_graph.__doc__

    def _ring_wait(self, done: Any, timeout: float | None, spin: float | None = None) -> None:
        """Spin (`spin` seconds, default the ring's), then sleep on the completion futex,
        until done() after a reap; the socket is looked at between sleeps. (The ring's wait
        returns at once with completions in: the loop reaps only when there is something to
        reap.)"""
        link, core = self._core.ring, self._core
        assert link is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        step = core.heartbeat_s
        while True:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise E.RequestTimeout(f"no completion within {timeout}s")
                step = min(core.heartbeat_s, left)
            if link.ring.wait(timeout=step, spin=spin):
                core.reap_ring()
                if done():
                    return
            elif link.ring.peer_closed:
                core.ring_closed()
            else:
                self._poll_once(0)
            if done():  # (the session failing finishes every request)
                return
            core.check_usable()

    def _wait_for(self, pending: Pending, timeout: float | None) -> None:
        if pending.id == 0:  # a local signal (a pool's release): set by another thread
            self._wait_local(pending, timeout)
            return
        lock = self._lock
        lock.acquire()  # (not `with`: see Session._submit)
        try:
            if pending._done:
                return
            # Requests held back by batch() must leave before we can wait on them.
            if self._batch:
                reqs, self._batch = self._batch, []
                self._send(reqs)
            link = self._core.ring
            if link is not None and pending.id in link.outstanding:
                # Most waits find the completion in already (it came while the caller
                # worked): take it in before setting up a wait.
                if link.ready() and link.reap(self._core.pending, self._core.unobserved) and pending._done:
                    return
                start = time.monotonic()
                plan = self._naps.plan(pending.id)  # (a graph run's: nap, then spin)
                overslept = False
                if plan is not None and plan[1] > 0:
                    time.sleep(plan[1] if timeout is None else min(plan[1], timeout))  # (the futex word unset: no wake)
                    overslept = pending._done or link.ready() > 0  # (its answer came during the nap)
                self._ring_wait(lambda: pending._done or pending.id not in link.outstanding, timeout,
                                plan[2] if plan is not None and plan[2] > 0 else None)
                if plan is not None and pending._done:
                    self._naps.learn(plan[0], time.monotonic() - start, overslept)
                if pending._done:
                    return
                if timeout is not None:  # failed on the ring: its error's message is on the socket
                    timeout = max(0.0, timeout - (time.monotonic() - start))
            self._drain_until(lambda: pending._done, timeout)
        finally:
            lock.release()

    @staticmethod
    def _wait_local(signal: Pending, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not signal._done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise E.RequestTimeout(f"not done within {timeout}s")
            time.sleep(0.001 if left is None else min(0.001, left))

    def _drain_until(self, done: Any, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        core = self._core
        while not done():
            core.check_usable()
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._recv_all()  # a zero timeout still looks once
                if done():
                    return
                raise E.RequestTimeout(f"no reply within {timeout}s")
            step = core.heartbeat_s
            if core.ring is not None and core.ring.outstanding:
                step = 0.001  # completions arrive on the ring, not the socket: look there often
            if deadline is not None:
                step = min(step, deadline - now)
            self._poll_once(step)

    # --- how this client moves bytes: the socket in the caller's thread -----------------------
    def _send(self, reqs: Sequence[P.Request]) -> None:
        """Send, staying within the daemon's credits: a full window waits for completions.
        The caller holds the lock (every caller does: a submission, a batch's end, a wait,
        the heartbeat); re-entering it here cost 0.7 µs a request."""
        core = self._core
        link = core.ring
        if link is not None:
            after = core.ring_route(reqs, core.unsent(reqs, self._batch))
            if after is not None:
                link.push(reqs, core.pending, self._wait_room, after)
                return
        step = max(1, core.max_inflight // 2)
        for i in range(0, len(reqs), step):
            chunk = reqs[i : i + step]
            # Created but not yet sent: the rest of reqs, and whatever a batch() holds.
            left = len(reqs) - i + len(self._batch or ())
            if core.socket_room(left) < len(chunk):
                self._drain_until(lambda: core.socket_room(left) >= len(chunk), None)
            for frame in core.encode(chunk):
                self._sock.send(frame, 0, copy=len(frame) < 65536)
                core.sub.frames += 1
        self._last_tx = time.monotonic()

    def _wait_room(self, need: int) -> None:
        """Wait until the ring has credits for `need` more descriptors (a full window)."""
        link = self._core.ring
        assert link is not None
        self._ring_wait(lambda: link.room >= need, None)

    def _poll_once(self, step: float) -> None:
        """One look at the socket and the daemon's pidfd (waiting up to `step` seconds)."""
        events = dict(self._poller.poll(int(max(step, 0) * 1000)))  # what pyzmq does with a float
        if self._sock in events:
            self._recv_all()
        elif self._daemon_pidfd >= 0 and self._daemon_pidfd in events:
            self._core.fail_all(E.ConnectionLost(f"the daemon (pid {self.server_pid}) exited"))
        elif not events:
            self._idle_check()

    def _recv_all(self) -> None:
        sock, core = self._sock, self._core
        core.reap_ring()
        while True:
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_rx = time.monotonic()
            core.on_frame(data)

    def _idle_check(self) -> None:
        """No traffic for a while: ping, and give up if the daemon has been silent too long."""
        now = time.monotonic()
        if now - self._last_rx > self._liveness_timeout:
            self._core.fail_all(E.ConnectionLost(f"the daemon at {self.endpoint} has not answered for {self._liveness_timeout}s"))
            return
        if now - self._last_tx >= self._core.heartbeat_s:
            self._send([self._core.ping()])

    def _heartbeat(self) -> None:
        while not self._stop_heartbeat.wait(self._core.heartbeat_s):
            if not self._lock.acquire(blocking=False):
                continue  # a caller is busy on the socket: that is traffic enough
            try:
                if self._closed or self._core.broken is not None or os.getpid() != self._core.pid:
                    return
                if time.monotonic() - self._last_tx >= self._core.heartbeat_s:
                    self._send([self._core.ping()])
                self._recv_all()
            except (zmq.ZMQError, E.TransferError):
                return
            finally:
                self._lock.release()


def connect(endpoint: str | None = None, **kwargs: Any) -> Client:
    """Open a session with the daemon at `endpoint` (default: $TRANSFER_ENDPOINT or the per-user socket)."""
    return Client(endpoint, **kwargs)
