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
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import zmq

from .. import errors as E
from .. import protocol as P
from ..memory import ShmFile
from ..transport._zmq import default_endpoint, ipc_path
if TYPE_CHECKING:
    from ._pool import SlotPool

from ._deferred import DeferredBuffer, DeferredState, Plan, Tensor, creation_site
from ._core import ClientCore, RequestMethods, DeviceBuffer, HostSegment, Pending, SharedSegment
from ._remote import RemoteAgent, RemoteSegment, register as _register_remote
from ._ringlink import RingLink, ring_able

__all__ = ["Client", "connect"]


class Client(RequestMethods):
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
        ring: bool | int = False,
    ) -> None:
        """`server_key` pins the daemon's CURVE public key (z85 or a key file) for tcp://;
        `client_keys` is this client's pair (a ``NAME.key_secret`` file or (public, secret)).
        `ring` (same host only) opens a shared-memory request ring (an int: its capacity,
        default 1024): copies, fills, checksums and fences then skip the socket (docs/ring.md)."""
        self._remote: Any = None  # the NIXL agent, made by the first register_remote
        self.endpoint = endpoint or os.environ.get("TRANSFER_ENDPOINT") or default_endpoint()
        self._lock = threading.RLock()
        self._core = ClientCore(self._wait_for)
        self._liveness_timeout = liveness_timeout
        self._max_inflight = max_inflight
        self._batch: list[P.Request] | None = None
        self._ring: RingLink | None = None
        #: Frames (zmq messages) this client has sent: what deferred creation saves.
        self.frames_sent = 0
        self._segments: dict[int, HostSegment] = {}
        self._closed = False
        self._daemon_pidfd = -1
        self._heartbeat_s = 0.5  # until the daemon says otherwise in hello
        path = ipc_path(self.endpoint)
        if path is not None and not path.exists():
            raise E.DaemonUnavailable(f"no daemon at {self.endpoint}: {path} does not exist (is transferd running?)")
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        mon = None
        if self.endpoint.startswith("tcp://"):
            from ..transport import _curve

            if server_key is not None:
                _curve.apply_client(self._sock, server_key, client_keys)
            mon = _curve.monitor(self._sock)
        self._sock.connect(self.endpoint)
        if mon is not None:  # a refused CURVE handshake fails now, not after connect_timeout
            try:
                _curve.wait_handshake(self._sock, mon, self.endpoint, connect_timeout, server_key is not None)
            except BaseException:
                self._sock.close(0)
                raise
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._last_rx = self._last_tx = time.monotonic()
        try:
            req, pending = self._core.new(P.Hello, P.VERSION, name or f"pid{os.getpid()}", os.getpid(), b"")
            self._send([req])
            try:
                info = pending.result(timeout=connect_timeout)
            except E.RequestTimeout:
                raise E.DaemonUnavailable(f"no daemon answered at {self.endpoint} within {connect_timeout}s") from None
        except BaseException:
            self._sock.close(0)
            raise
        self.session_id: int = info["session"]
        self.server_pid: int = info["server_pid"]
        self.backend: dict[str, Any] = info["backend"]
        self._shm_dir = Path(info["shm_dir"])
        lim = info["limits"]
        self._core.limits = P.Limits(**{k: int(v) for k, v in lim.items() if k in P.Limits.__dataclass_fields__})
        self._heartbeat_s = float(info["heartbeat_s"])
        self._max_inflight = max(1, min(self._max_inflight, int(info.get("max_inflight", self._max_inflight))))
        # Deferred creation: allocations, descriptors and plans are answered here and
        # travel with their first use. deferred=False sends each at once (for debugging).
        self._core.deferred = DeferredState(info.get("arenas", ())) if deferred and info.get("arenas") else None
        if path is not None and watch_daemon_pid:
            with contextlib.suppress(OSError):
                self._daemon_pidfd = os.pidfd_open(self.server_pid)
                self._poller.register(self._daemon_pidfd, zmq.POLLIN)
        if ring:
            try:
                self._open_ring(1024 if ring is True else int(ring))
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
                if self._core.broken is None and os.getpid() == self._core.pid:
                    req, pending = self._core.new(P.Close)
                    self._send([req])
                    pending.result(timeout=min(5.0, self._liveness_timeout))
            except E.TransferError:
                pass
            finally:
                for seg in self._segments.values():
                    seg._unmap()
                self._segments.clear()
                self._sock.close(0)
                if self._ring is not None:
                    self._ring.close()
                    self._ring = None
                if self._daemon_pidfd >= 0:
                    os.close(self._daemon_pidfd)
                    self._daemon_pidfd = -1
                self._core.fail_all(E.SessionClosed("the client was closed"))
                if self._remote is not None:  # after Close: the daemon no longer reads our buffers
                    self._remote.close()
                    self._remote = None

    # --- the request ring ---------------------------------------------------------------------
    def _open_ring(self, capacity: int) -> None:
        info = self._call(P.OpenRing, capacity)
        self._ring = RingLink(info, self._shm_dir)

    @property
    def ring(self) -> bool:
        """Whether data requests take the shared-memory ring."""
        return self._ring is not None

    def _ring_route(self, reqs: Sequence[P.Request]) -> bool:
        """The ring keeps order only with itself: use it when nothing sent on the socket is pending.

        (The daemon takes what is in the ring before each frame it reads, so the other
        direction, ring then socket, is ordered already.)"""
        link = self._ring
        if link is None or not ring_able(reqs):
            return False
        pending = self._core.pending
        unsent = (reqs[0].id in pending if len(reqs) == 1 else sum(1 for r in reqs if r.id in pending)) + len(self._batch or ())
        return len(pending) - len(link.outstanding) - unsent == 0

    def _ring_reap(self) -> None:
        if self._ring is not None and self._ring.outstanding:
            self._ring.reap(self._core.pending, self._core.unobserved)

    def _ring_wait(self, done: Any, timeout: float | None) -> None:
        """Spin, then sleep on the completion futex, until done(); the socket is looked at between sleeps."""
        link, core = self._ring, self._core
        assert link is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            link.reap(core.pending, core.unobserved)
            if done():
                return
            core.check_usable()
            step = self._heartbeat_s
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise E.RequestTimeout(f"no completion within {timeout}s")
                step = min(step, left)
            if link.ring.wait(timeout=step) == 0:
                if link.ring.peer_closed:
                    core.fail_all(E.SessionClosed("the daemon ended this session (its ring is closed)"))
                    link.outstanding.clear()
                else:
                    self._poll_once(0)

    # --- resources -------------------------------------------------------------------------
    def segment(self, nbytes: int) -> HostSegment:
        """Shared memory of `nbytes`, mapped here and in the daemon."""
        info = self._call(P.RegisterHost, nbytes)
        shm = ShmFile.attach(info["path"], info["nbytes"], expect_dir=self._shm_dir)
        seg = HostSegment(self, info["va"], info["nbytes"], shm)
        self._segments[seg.va] = seg
        return seg

    def alloc(self, nbytes: int, device: int = -1) -> DeviceBuffer | DeferredBuffer:
        """A zeroed buffer on one of the daemon's devices.

        Deferred (the default): the VA comes from this session's arena at once, and
        the daemon allocates when the first request touching it arrives; an error
        then names the line that called alloc.
        """
        if self._core.deferred is not None:
            with self._lock:
                return self._core.deferred.alloc(nbytes, device, creation_site())
        info = self._call(P.Alloc, nbytes, device)
        return DeviceBuffer(self, info["va"], info["nbytes"], info["device"])

    def free(self, resource: HostSegment | DeviceBuffer) -> None:
        """Release a segment or buffer (waits for the daemon, so its VA is dead afterwards)."""
        if isinstance(resource, HostSegment):
            self._call(P.Unregister, resource.va)
            self._segments.pop(resource.va, None)
            resource._unmap()
        elif isinstance(resource, DeviceBuffer):
            self._call(P.Free, resource.va)
        elif isinstance(resource, DeferredBuffer):
            with self._lock:
                self._core.deferred.free(resource)  # type: ignore[union-attr]  # travels with the next frame
        elif isinstance(resource, RemoteSegment):
            if not resource.freed:
                self._call(P.Unregister, resource.va)  # the daemon lets go first, then we deregister
                resource._deregister(self._remote)
        else:
            raise TypeError(f"cannot free {type(resource).__name__}")

    def register_remote(self, array: np.ndarray) -> RemoteSegment:
        """Register `array` (this process's memory) with NIXL and map it in the daemon as a
        remote segment: copies from its VAs are one-sided READs, copies to it WRITEs."""
        with self._lock:
            if self._remote is None:
                self._remote = RemoteAgent(self.session_id)
            return _register_remote(self, self._remote, array, self._call)

    def remote_segment(self, nbytes: int) -> RemoteSegment:
        """A new zeroed buffer of `nbytes` here, registered as a remote segment."""
        return self.register_remote(np.zeros(nbytes, dtype=np.uint8))

    def pool(self, slot_nbytes: int, slots: int = 4) -> "SlotPool":
        """Batch slots over one segment: acquire, write, submit; a slot returns once the daemon is done."""
        from ._pool import SlotPool

        return SlotPool(self, slot_nbytes, slots)

    def share(self, resource: HostSegment | DeviceBuffer) -> bytes:
        """A token that lets another session name this segment's VAs (fan-in to one consumer)."""
        return (self._call(P.Share, resource.va))["token"]

    def attach(self, token: bytes) -> SharedSegment:
        """Use a segment another session shared; valid until its owner frees it."""
        info = self._call(P.Attach, token)
        return SharedSegment(info["va"], info["nbytes"], info["kind"], info["device"])

    def tensor(self, owner: Any, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0, strides: Sequence[int] | None = None) -> Tensor:
        """A tensor descriptor over a buffer or segment: defined on the daemon at first use."""
        t = Tensor(owner, (shape,) if isinstance(shape, int) else shape, dtype, offset, strides)
        if self._core.deferred is None:
            self._define_now(t)
        return t

    def plan(self, op: str, params: dict[str, Any] | None = None, *, device: int = -1, placement: str = "") -> Plan:
        """An operator configuration, reusable across compute calls; defined at first use."""
        p = Plan(op, params, device=device, placement=placement)
        if self._core.deferred is None:
            self._define_now(p)
        return p

    def _define_now(self, obj: Tensor | Plan) -> None:
        kind = P.DEF_TENSOR if isinstance(obj, Tensor) else P.DEF_PLAN
        self._call(P.Define, kind, obj.id, obj.version, obj.definition(), obj.site)
        obj.sent_version = obj.version

    # --- data requests (return Pending) ---------------------------------------------------

    def fence(self, stream: int = 0, timeout: float | None = None) -> None:
        """Wait until everything submitted on `stream` is done; raise the first unobserved failure."""
        self._call(P.Fence, stream, timeout=timeout)
        link = self._ring
        if link is not None and not link.details_in():
            with self._lock:  # failures seen on the ring: their messages come on the socket
                self._drain_until(link.details_in, timeout)
        err = self._core.take_unobserved()
        if err is not None:
            raise err

    def poll(self) -> int:
        """Take in whatever replies have arrived, without waiting; return how many requests are still pending."""
        with self._lock:
            self._core.check_usable()
            self._recv_all()
            return len(self._core.pending)

    def stats(self) -> dict[str, Any]:
        return self._call(P.Stats)

    def _io_lock(self) -> threading.RLock:
        return self._lock

    # --- machinery -------------------------------------------------------------------------
    def _call(self, cls: type[P.Request], *args: Any, timeout: float | None = None) -> Any:
        """A synchronous call: its frame carries a Wait marker, so the daemon counts the round trip."""
        return self._submit(cls, *args, blocking=True).result(timeout)

    def _submit(self, cls: type[P.Request], *args: Any, objects: Sequence[Any] = (), blocking: bool = False) -> Pending:
        with self._lock:
            reqs, pending = self._core.prepare(cls, args, objects, blocking)
            if self._batch is not None:
                self._batch.extend(reqs)
            else:
                self._send(reqs)
            return pending

    def _send(self, reqs: Sequence[P.Request]) -> None:
        """Send, staying within the daemon's credits: a full window waits for completions."""
        with self._lock:
            if self._ring_route(reqs):
                link = self._ring
                assert link is not None
                link.push(reqs, self._core.pending, lambda: self._ring_wait(lambda: len(link.outstanding) < link.credits, None))
                return
            pending, limit = self._core.pending, self._max_inflight
            step = max(1, limit // 2)
            for i in range(0, len(reqs), step):
                chunk = reqs[i : i + step]
                # Created but not yet sent: the rest of reqs, and whatever a batch() holds.
                unsent = len(reqs) - i + len(self._batch or ())
                if len(pending) - unsent + len(chunk) > limit:
                    self._drain_until(lambda: len(pending) - unsent + len(chunk) <= limit, None)
                for frame in self._core.encode(chunk):
                    self._sock.send(frame, copy=len(frame) < 65536)
                    self.frames_sent += 1
            self._last_tx = time.monotonic()

    def _wait_for(self, pending: Pending, timeout: float | None) -> None:
        with self._lock:
            if pending._done:
                return
            # Requests held back by batch() must leave before we can wait on them.
            if self._batch:
                reqs, self._batch = self._batch, []
                self._send(reqs)
            if self._ring is not None and pending.id in self._ring.outstanding:
                start = time.monotonic()
                link = self._ring
                self._ring_wait(lambda: pending._done or pending.id not in link.outstanding, timeout)
                if pending._done:
                    return
                if timeout is not None:  # failed on the ring: its error's message is on the socket
                    timeout = max(0.0, timeout - (time.monotonic() - start))
            self._drain_until(lambda: pending._done, timeout)

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
            step = self._heartbeat_s
            if self._ring is not None and self._ring.outstanding:
                step = 0.001  # completions arrive on the ring, not the socket: look there often
            if deadline is not None:
                step = min(step, deadline - now)
            self._poll_once(step)

    def _poll_once(self, step: float) -> None:
        """One look at the socket and the daemon's pidfd (waiting up to `step` seconds)."""
        events = dict(self._poller.poll(max(step, 0) * 1000))
        if self._sock in events:
            self._recv_all()
        elif self._daemon_pidfd >= 0 and self._daemon_pidfd in events:
            self._core.fail_all(E.ConnectionLost(f"the daemon (pid {self.server_pid}) exited"))
        elif not events:
            self._idle_check()

    def _recv_all(self) -> None:
        sock, core = self._sock, self._core
        self._ring_reap()
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
        if now - self._last_tx >= self._heartbeat_s:
            self._ping()

    def _ping(self) -> None:
        req, _ = self._core.new(P.Ping)
        self._core.pending.pop(req.id, None)  # nobody waits on it; its reply just proves liveness
        self._send([req])

    def _heartbeat(self) -> None:
        while not self._stop_heartbeat.wait(self._heartbeat_s):
            if not self._lock.acquire(blocking=False):
                continue  # a caller is busy on the socket: that is traffic enough
            try:
                if self._closed or self._core.broken is not None or os.getpid() != self._core.pid:
                    return
                if time.monotonic() - self._last_tx >= self._heartbeat_s:
                    self._ping()
                self._recv_all()
            except (zmq.ZMQError, E.TransferError):
                return
            finally:
                self._lock.release()




def connect(endpoint: str | None = None, **kwargs: Any) -> Client:
    """Open a session with the daemon at `endpoint` (default: $TRANSFER_ENDPOINT or the per-user socket)."""
    return Client(endpoint, **kwargs)
