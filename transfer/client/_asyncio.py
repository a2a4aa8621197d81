"""The asyncio client: the blocking client's API, with awaits where it waits.

The same client as the trio one (client._evloop), over asyncio's primitives:
submitting (`copy`, `fill`, `checksum`, `copy_many`, `compute`) returns an
awaitable `AsyncioPending` at once, so a producer keeps many requests in flight
without a task each; methods that wait (`segment`, `fence`, `pool.acquire`) are
awaited. No thread: the socket is pumped by a loop reader on zmq's FD
(transport._zmq_asyncio), the daemon's pidfd is a loop reader too, and two
tasks run beside the caller's: heartbeats, and with the ring its completion
reaper, which sleeps on the session's completion doorbell pipe (asyncio cannot
wait on a futex; docs/ring.md). Errors are the request's own exceptions.

Written on asyncio directly, not anyio: the loop primitives it needs are four
(docs/architecture.md, "One client, three ways to wait").
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from typing import Any, AsyncIterator, Coroutine

import zmq

from .. import errors as E
from ..transport._fds import daemon_pidfd
from ..transport._zmq import ipc_path, resolve_endpoint
from ..transport._zmq_asyncio import AsyncioPump
from ._evloop import BELL, IDLE, YIELD, LoopSession
from .._pending import AwaitablePending, Pending
from ..ring import RingLink
from ._socket import open_socket

log = logging.getLogger("transfer.client")

__all__ = ["AsyncioClient", "AsyncioPending", "open_asyncio_client"]

class AsyncioPending(AwaitablePending):
    """Await it for the result (or the error) of one request."""

    __slots__ = ()


class AsyncioClient(LoopSession):
    """A session with a transfer daemon inside an asyncio program; made by `open_asyncio_client`."""

    def __init__(self, endpoint: str, sock: zmq.Socket[bytes], liveness_timeout: float, max_inflight: int) -> None:
        super().__init__(endpoint, sock, AsyncioPending, liveness_timeout, max_inflight)
        self._loop = asyncio.get_running_loop()
        self._pump = AsyncioPump(sock, self._loop, self._on_message, self._pump_failed)
        self._ring_kick = asyncio.Event()  # set when descriptors go out: the reaper has work
        self._tasks: set[asyncio.Task[None]] = set()
        self._pidfd = -1

    async def close(self) -> None:
        """End the session: the daemon releases everything it holds for us (`open_asyncio_client`
        does this on exit). A cancellation while closing still tears the session down here."""
        if self._closed:
            return
        self._closed = True
        try:
            with contextlib.suppress(E.TransferError, TimeoutError):
                async with asyncio.timeout(min(5.0, self._liveness_timeout)):
                    await self._run(self._op_close())
        finally:
            await self._teardown()

    async def _teardown(self) -> None:
        """Local teardown: background work stopped before the fds it watches close."""
        self._closed = True
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._pump.close()
        self._unwatch_daemon()
        self._core.release()
        self._sock.close(0)

    # --- asyncio's primitives (client._evloop does the rest) ---------------------------------
    async def _yield(self) -> None:
        await asyncio.sleep(0)

    async def _cancel_point(self) -> None:
        """Nothing: asyncio delivers a cancellation at the task's next suspension."""

    async def _sleep(self, p: Pending, timeout: float | None) -> None:
        if p._waker is None:
            p._waker = asyncio.Event()
        if timeout is None:
            await p._waker.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await p._waker.wait()

    def _kick_ring(self) -> None:
        self._ring_kick.set()

    def _spawn_reaper(self, link: RingLink) -> None:
        self._spawn(self._reap_ring(link))

    # --- background work ------------------------------------------------------------------------
    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A task the session owns: cancelled on close; if it fails, the session fails with it
        (its requests raise, rather than the error vanishing with an unawaited task)."""
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("transfer asyncio client: background task failed", exc_info=exc)
            self._core.fail_all(E.ConnectionLost(f"the client's background task failed: {exc!r}"))

    def _pump_failed(self, exc: BaseException) -> None:
        self._core.fail_all(E.ConnectionLost(f"the control socket failed: {exc}"))

    async def _reap_ring(self, link: RingLink) -> None:
        """Drive the shared reaper (LoopSession._reaper) with asyncio's waits."""
        kick = self._ring_kick
        for need in self._reaper(link):
            if need is YIELD:
                await asyncio.sleep(0)
            elif need is IDLE:
                kick.clear()
                await kick.wait()
            elif need is BELL:
                await self._readable(link.cbell_fd)

    async def _readable(self, fd: int) -> None:
        """Until `fd` is readable (a loop reader for the duration of the wait)."""
        fut = self._loop.create_future()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        self._loop.add_reader(fd, ready)
        try:
            await fut
        finally:
            self._loop.remove_reader(fd)

    async def _liveness(self) -> None:
        while True:
            await asyncio.sleep(self._core.heartbeat_s)
            if not self._heartbeat():
                return

    def _watch_daemon(self) -> None:
        """On this host, the daemon's exit fails every request at once (its pidfd turns readable)."""
        with contextlib.suppress(OSError):
            self._pidfd = daemon_pidfd(self._core.fd_socket, self.server_pid)
            self._loop.add_reader(self._pidfd, self._pidfd_readable)

    def _pidfd_readable(self) -> None:
        self._unwatch_daemon()
        self._daemon_exited()

    def _unwatch_daemon(self) -> None:
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1


@contextlib.asynccontextmanager
async def open_asyncio_client(
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
) -> AsyncIterator[AsyncioClient]:
    """An asyncio session with the daemon (the arguments are `transfer.connect`'s);
    everything it holds is released on exit. A failing request raises its own exception."""
    endpoint = resolve_endpoint(endpoint)
    if endpoint.startswith("tcp://"):  # the CURVE handshake wait blocks: not on the event loop
        sock = await asyncio.to_thread(functools.partial(open_socket, endpoint, server_key, client_keys, connect_timeout))
    else:
        sock = open_socket(endpoint, server_key, client_keys, connect_timeout)
    try:
        client = AsyncioClient(endpoint, sock, liveness_timeout, max_inflight)
    except BaseException:
        sock.close(0)
        raise
    try:
        try:
            await client._run(client._op_hello(name, deferred, priority), connect_timeout)
        except E.RequestTimeout:
            raise E.DaemonUnavailable(f"no daemon answered at {endpoint} within {connect_timeout}s") from None
    except BaseException:
        await client._teardown()  # no session to close
        raise
    try:
        client._spawn(client._liveness())
        if ipc_path(endpoint) is not None and watch_daemon_pid:
            client._watch_daemon()
        if ring is not False:
            await client._start_ring(ring)
        yield client
    finally:
        await client.close()
