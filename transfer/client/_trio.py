"""The trio client: the blocking client's API, with awaits where it waits.

Everything but waiting and I/O is shared (client._session, client._core), and
everything but trio's own primitives with the asyncio client (client._evloop).
Submitting (`copy`, `fill`, `checksum`, `copy_many`, `compute`) returns an
awaitable `TrioPending` at once, so a producer keeps many requests in flight
without a task each; methods that wait (`segment`, `fence`, `pool.acquire`)
are awaited. Background tasks, all in one nursery owned by `open_client`:
the socket pump (transport._zmq.SocketPump), liveness (heartbeats, the
daemon's pid on this host) and, with `ring=True`, the ring's completion
reaper, which sleeps on the session's completion doorbell pipe (trio cannot
wait on a futex; docs/ring.md).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, AsyncIterator

import trio
import zmq

from .. import errors as E
from ..transport._fds import daemon_pidfd
from ..transport._zmq import SocketPump, ipc_path, resolve_endpoint
from ._evloop import BELL, IDLE, YIELD, LoopSession
from .._pending import AwaitablePending, Pending
from ..ring import RingLink
from ._socket import open_socket

__all__ = ["TrioClient", "open_client", "TrioPending"]


class TrioPending(AwaitablePending):
    """Await it for the result (or the error) of one request."""

    __slots__ = ()


class TrioClient(LoopSession):
    """A session with a transfer daemon inside a trio program; made by `open_client`.

    Everything but trio's own primitives is shared with the asyncio client (client._evloop)."""

    def __init__(self, endpoint: str, sock: zmq.Socket[bytes], liveness_timeout: float, max_inflight: int) -> None:
        super().__init__(endpoint, sock, TrioPending, liveness_timeout, max_inflight)
        self._pump = SocketPump(sock)
        self._ring_kick = trio.Event()  # set when descriptors go out: the reaper has work
        self._bg = trio.CancelScope()
        self._bg_nursery: trio.Nursery | None = None
        self._bg_done = trio.Event()

    async def close(self) -> None:
        """End the session: the daemon releases everything it holds for us (`open_client` does this on exit)."""
        if self._closed:
            return
        self._closed = True
        with trio.move_on_after(min(5.0, self._liveness_timeout)) as scope:
            scope.shield = True
            with contextlib.suppress(E.TransferError):
                await self._run(self._op_close())
        with trio.CancelScope(shield=True):
            self._bg.cancel()
            await self._bg_done.wait()  # the tasks are gone: their fds can close
        self._core.release()
        self._sock.close(0)

    # --- trio's primitives (client._evloop does the rest) ------------------------------------
    async def _yield(self) -> None:
        await trio.lowlevel.checkpoint()  # a pass of trio's run loop (~10 us)

    async def _cancel_point(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()

    async def _sleep(self, p: Pending, timeout: float | None) -> None:
        if p._waker is None:
            p._waker = trio.Event()
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await p._waker.wait()

    def _kick_ring(self) -> None:
        self._ring_kick.set()

    def _spawn_reaper(self, link: RingLink) -> None:
        assert self._bg_nursery is not None
        self._bg_nursery.start_soon(self._reap_ring, link)

    # --- background tasks ---------------------------------------------------------------------
    async def _serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The socket pump and whatever else the session needs, until close() cancels them."""
        try:
            with self._bg:
                async with trio.open_nursery() as nursery:
                    self._bg_nursery = nursery
                    nursery.start_soon(self._pump.run, self._on_message)
                    task_status.started()
        finally:
            self._bg_done.set()

    async def _reap_ring(self, link: RingLink) -> None:
        """Drive the shared reaper (LoopSession._reaper) with trio's waits."""
        for need in self._reaper(link):
            if need is YIELD:
                await trio.lowlevel.checkpoint()
            elif need is IDLE:
                self._ring_kick = trio.Event()
                await self._ring_kick.wait()
            elif need is BELL:
                await trio.lowlevel.wait_readable(link.cbell_fd)

    async def _liveness(self) -> None:
        while True:
            await trio.sleep(self._core.heartbeat_s)
            if not self._heartbeat():
                return

    async def _watch_daemon(self, pidfd: int) -> None:
        try:
            await trio.lowlevel.wait_readable(pidfd)
            self._daemon_exited()
        finally:
            os.close(pidfd)


@contextlib.asynccontextmanager
async def open_client(
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
) -> AsyncIterator[TrioClient]:
    """A trio session with the daemon (the arguments are `transfer.connect`'s); everything
    it holds is released on exit. A failing request raises its own exception out of the
    block, never an ExceptionGroup wrapping it."""
    endpoint = resolve_endpoint(endpoint)
    if endpoint.startswith("tcp://"):  # the CURVE handshake wait blocks: not on the event loop
        sock = await trio.to_thread.run_sync(open_socket, endpoint, server_key, client_keys, connect_timeout)
    else:
        sock = open_socket(endpoint, server_key, client_keys, connect_timeout)
    client = TrioClient(endpoint, sock, liveness_timeout, max_inflight)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client._serve)
            try:
                try:
                    await client._run(client._op_hello(name, deferred, priority), connect_timeout)
                except E.RequestTimeout:
                    raise E.DaemonUnavailable(f"no daemon answered at {endpoint} within {connect_timeout}s") from None
            except BaseException:
                client._bg.cancel()
                raise
            try:
                bg = client._bg_nursery
                assert bg is not None
                bg.start_soon(client._liveness)
                if ipc_path(endpoint) is not None and watch_daemon_pid:
                    with contextlib.suppress(OSError):
                        bg.start_soon(client._watch_daemon, daemon_pidfd(client._core.fd_socket, client.server_pid))
                if ring is not False:
                    await client._start_ring(ring)
                yield client
            finally:
                await client.close()
    except BaseExceptionGroup as group:
        # trio's strict exception groups wrap the block's one error: hand it back as itself.
        if len(group.exceptions) != 1:
            raise
        exc = group.exceptions[0]
        raise exc from exc.__cause__
    finally:
        client._core.release()
        sock.close(0)
