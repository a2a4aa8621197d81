"""The trio client: the same concepts as the blocking one, as awaitables.

Submitting (`copy`, `fill`, `checksum`, `copy_many`) is synchronous and
returns an awaitable `Pending`, so a producer keeps many requests in flight
without a task each; control calls (`segment`, `alloc`, `fence`) are async.
One background task owns the socket (see transport._zmq.SocketPump) and
another watches liveness: heartbeats, and the daemon's pid on this host.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

import numpy as np
import trio
import zmq

from .. import errors as E
from .. import protocol as P
from ..memory import ShmFile
from ..transport._zmq import SocketPump, default_endpoint, ipc_path
from ._deferred import DeferredBuffer, DeferredState, Plan, Tensor, creation_site
from ._core import ClientCore, RequestMethods, DeviceBuffer, HostSegment, Pending, SharedSegment

__all__ = ["TrioClient", "open_client", "TrioPending"]


class TrioPending:
    """Await it for the result (or the error) of one request."""

    __slots__ = ("_p", "_event")

    def __init__(self, p: Pending) -> None:
        self._p = p
        self._event = trio.Event()
        if p._done:
            self._event.set()
        else:
            p._callback = lambda _p: self._event.set()

    @property
    def id(self) -> int:
        return self._p.id

    def done(self) -> bool:
        return self._p._done

    async def wait(self) -> Any:
        await self._event.wait()
        return self._p.result()

    def __await__(self) -> Any:
        return self.wait().__await__()


def _no_blocking_wait(p: Pending, timeout: float | None) -> None:
    raise RuntimeError("in a trio client, await the request instead of calling result()")


class TrioClient(RequestMethods):
    def __init__(self, endpoint: str, sock: zmq.Socket, name: str, liveness_timeout: float) -> None:
        self.endpoint = endpoint
        self._sock = sock
        self._pump = SocketPump(sock)
        self._core = ClientCore(_no_blocking_wait)
        self._name = name
        self._liveness_timeout = liveness_timeout
        self._batch: list[P.Request] | None = None
        self._held: deque[P.Request] = deque()
        self._max_inflight = 1 << 16
        self._segments: dict[int, HostSegment] = {}
        self._last_rx = time.monotonic()
        self._heartbeat_s = 0.5
        self.session_id = 0
        self.server_pid = 0
        self.backend: dict[str, Any] = {}
        self._shm_dir = Path("/dev/shm")

    # --- resources -------------------------------------------------------------------
    async def segment(self, nbytes: int) -> HostSegment:
        info = await self._call(P.RegisterHost, nbytes)
        shm = ShmFile.attach(info["path"], info["nbytes"], expect_dir=self._shm_dir)
        seg = HostSegment(self, info["va"], info["nbytes"], shm)
        self._segments[seg.va] = seg
        return seg

    async def alloc(self, nbytes: int, device: int = -1) -> DeviceBuffer | DeferredBuffer:
        """A zeroed device buffer; deferred (the default): its VA at once, allocated at first use."""
        if self._core.deferred is not None:
            return self._core.deferred.alloc(nbytes, device, creation_site())
        info = await self._call(P.Alloc, nbytes, device)
        return DeviceBuffer(self, info["va"], info["nbytes"], info["device"])

    async def free(self, resource: HostSegment | DeviceBuffer) -> None:
        if isinstance(resource, HostSegment):
            await self._call(P.Unregister, resource.va)
            self._segments.pop(resource.va, None)
            resource._unmap()
        elif isinstance(resource, DeviceBuffer):
            await self._call(P.Free, resource.va)
        elif isinstance(resource, DeferredBuffer):
            self._core.deferred.free(resource)  # travels with the next frame
        else:
            raise TypeError(f"cannot free {type(resource).__name__}")

    async def tensor(self, owner: Any, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0, strides: Sequence[int] | None = None) -> Tensor:
        """A tensor descriptor, defined on the daemon at first use (at once in eager mode)."""
        t = Tensor(owner, (shape,) if isinstance(shape, int) else shape, dtype, offset, strides)
        if self._core.deferred is None:
            await self._define_now(t)
        return t

    async def plan(self, op: str, params: dict[str, Any] | None = None, *, device: int = -1, placement: str = "") -> Plan:
        """An operator configuration, defined on the daemon at first use (at once in eager mode)."""
        p = Plan(op, params, device=device, placement=placement)
        if self._core.deferred is None:
            await self._define_now(p)
        return p

    async def _define_now(self, obj: Tensor | Plan) -> None:
        kind = P.DEF_TENSOR if isinstance(obj, Tensor) else P.DEF_PLAN
        await self._call(P.Define, kind, obj.id, obj.version, obj.definition(), obj.site)
        obj.sent_version = obj.version

    async def pool(self, slot_nbytes: int, slots: int = 4) -> Any:
        """Batch slots over one segment (see SlotPool); `await pool.acquire()`."""
        from ._pool import TrioSlotPool

        return await TrioSlotPool.create(self, slot_nbytes, slots)

    async def share(self, resource: HostSegment | DeviceBuffer) -> bytes:
        """A token that lets another session name this segment's VAs (fan-in to one consumer)."""
        return (await self._call(P.Share, resource.va))["token"]

    async def attach(self, token: bytes) -> SharedSegment:
        """Use a segment another session shared; valid until its owner frees it."""
        info = await self._call(P.Attach, token)
        return SharedSegment(info["va"], info["nbytes"], info["kind"], info["device"])

    # --- data requests -----------------------------------------------------------------

    async def fence(self, stream: int = 0) -> None:
        await self._call(P.Fence, stream)
        err = self._core.take_unobserved()
        if err is not None:
            raise err

    async def stats(self) -> dict[str, Any]:
        return await self._call(P.Stats)


    # --- machinery -----------------------------------------------------------------------
    async def _call(self, cls: type[P.Request], *args: Any) -> Any:
        """A call the task waits on: its frame carries a Wait marker (a counted round trip)."""
        return await self._submit(cls, *args, blocking=True)

    def _submit(self, cls: type[P.Request], *args: Any, objects: Sequence[Any] = (), blocking: bool = False) -> TrioPending:
        reqs, pending = self._core.prepare(cls, args, objects, blocking)
        if self._batch is not None:
            self._batch.extend(reqs)
        else:
            self._send(reqs)
        return TrioPending(pending)

    def _send(self, reqs: Sequence[P.Request]) -> None:
        """Queue for sending; requests beyond the daemon's credits wait for completions."""
        self._held.extend(reqs)
        self._release_held()

    def _release_held(self) -> None:
        held, limit = self._held, self._max_inflight
        if not held:
            return
        room = limit - (len(self._core.pending) - len(held) - len(self._batch or ()))
        if room <= 0:
            return
        chunk = [held.popleft() for _ in range(min(room, len(held)))]
        for frame in self._core.encode(chunk):
            self._pump.send_nowait([frame])

    def _on_message(self, parts: list[bytes]) -> None:
        self._last_rx = time.monotonic()
        for part in parts:
            self._core.on_frame(part)
        self._release_held()

    async def _liveness(self) -> None:
        while True:
            await trio.sleep(self._heartbeat_s)
            if time.monotonic() - self._last_rx > self._liveness_timeout:
                self._core.fail_all(E.ConnectionLost(f"the daemon at {self.endpoint} has not answered for {self._liveness_timeout}s"))
                return
            req, _ = self._core.new(P.Ping)
            self._core.pending.pop(req.id, None)
            self._send([req])

    async def _watch_daemon(self, pidfd: int) -> None:
        try:
            await trio.lowlevel.wait_readable(pidfd)
            self._core.fail_all(E.ConnectionLost(f"the daemon (pid {self.server_pid}) exited"))
        finally:
            os.close(pidfd)


@contextlib.asynccontextmanager
async def open_client(
    endpoint: str | None = None,
    *,
    name: str = "",
    connect_timeout: float = 5.0,
    liveness_timeout: float = 10.0,
    server_key: Any = None,
    client_keys: Any = None,
    deferred: bool = True,
) -> AsyncIterator[TrioClient]:
    """A trio session with the daemon; everything it holds is released on exit.

    `server_key` / `client_keys`: CURVE for tcp:// (as `transfer.connect`; a refused
    handshake shows here as DaemonUnavailable after `connect_timeout`)."""
    endpoint = endpoint or os.environ.get("TRANSFER_ENDPOINT") or default_endpoint()
    path = ipc_path(endpoint)
    if path is not None and not path.exists():
        raise E.DaemonUnavailable(f"no daemon at {endpoint}: {path} does not exist (is transferd running?)")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if server_key is not None:
        from ..transport._curve import apply_client

        apply_client(sock, server_key, client_keys)
    sock.connect(endpoint)
    client = TrioClient(endpoint, sock, name or f"pid{os.getpid()}", liveness_timeout)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._pump.run, client._on_message)
            with trio.move_on_after(connect_timeout) as scope:
                info = await client._call(P.Hello, P.VERSION, client._name, os.getpid(), b"")
            if scope.cancelled_caught:
                raise E.DaemonUnavailable(f"no daemon answered at {endpoint} within {connect_timeout}s")
            client.session_id = info["session"]
            client.server_pid = info["server_pid"]
            client.backend = info["backend"]
            client._shm_dir = Path(info["shm_dir"])
            client._heartbeat_s = float(info["heartbeat_s"])
            client._max_inflight = max(1, int(info.get("max_inflight", client._max_inflight)))
            if deferred and info.get("arenas"):
                client._core.deferred = DeferredState(info["arenas"])
            client._core.limits = P.Limits(**{k: int(v) for k, v in info["limits"].items() if k in P.Limits.__dataclass_fields__})
            nursery.start_soon(client._liveness)
            if path is not None:
                with contextlib.suppress(OSError):
                    nursery.start_soon(client._watch_daemon, os.pidfd_open(client.server_pid))
            try:
                yield client
            finally:
                with trio.move_on_after(min(5.0, liveness_timeout)) as close_scope:
                    close_scope.shield = True
                    if client._core.broken is None:
                        with contextlib.suppress(E.TransferError):
                            await client._call(P.Close)
                nursery.cancel_scope.cancel()
    finally:
        for seg in client._segments.values():
            seg._unmap()
        client._core.fail_all(E.SessionClosed("the client was closed"))
        sock.close(0)
