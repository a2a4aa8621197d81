"""The trio client: the blocking client's API, with awaits where it waits.

Everything but waiting and I/O is shared (client._session, client._core).
Submitting (`copy`, `fill`, `checksum`, `copy_many`, `compute`) returns an
awaitable `TrioPending` at once, so a producer keeps many requests in flight
without a task each; methods that wait (`segment`, `fence`, `pool.acquire`)
are awaited. Background tasks, all in one nursery owned by `open_client`:
the socket pump (transport._zmq.SocketPump), liveness (heartbeats, the
daemon's pid on this host) and, with `ring=True`, the ring's completion
reaper, which sleeps on the session's completion doorbell FIFO (trio cannot
wait on a futex; docs/ring.md).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections import deque
from typing import Any, AsyncIterator, Sequence, TypeVar

import trio
import zmq

from .. import errors as E
from .. import protocol as P
from ..transport._zmq import SocketPump, default_endpoint, ipc_path
from ._pending import Pending
from ._ringlink import RingLink, descriptors_of
from ._session import Op, Session, open_socket

__all__ = ["TrioClient", "open_client", "TrioPending"]

#: How long the ring reaper polls for a completion before it sleeps on the doorbell.
_SPIN_S = 30e-6

T = TypeVar("T")


class TrioPending(Pending):
    """Await it for the result (or the error) of one request."""

    __slots__ = ()

    def exception(self, timeout: float | None = None) -> E.TransferError | None:
        if not self._done:
            raise RuntimeError("in a trio client, await the request instead of calling result()")
        return super().exception(timeout)

    async def wait(self) -> Any:
        await self._waiter(self, None)
        return self.result()

    def __await__(self) -> Any:
        return self.wait().__await__()


class TrioClient(Session):
    """A session with a transfer daemon inside a trio program; made by `open_client`."""

    def __init__(self, endpoint: str, sock: zmq.Socket, liveness_timeout: float, max_inflight: int) -> None:
        super().__init__(endpoint, TrioPending, self._wait)
        self._sock = sock
        self._pump = SocketPump(sock)
        self._liveness_timeout = liveness_timeout
        self._core.max_inflight = max(1, max_inflight)
        #: Submitted, not yet handed to the ring or the socket (credits), in order.
        self._held: deque[P.Request] = deque()
        self._last_rx = time.monotonic()
        self._ring_kick = trio.Event()  # set when descriptors go out: the reaper has work
        self._bg = trio.CancelScope()
        self._bg_nursery: trio.Nursery | None = None
        self._bg_done = trio.Event()
        self._closed = False

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

    def poll(self) -> int:
        """Take in what the ring has completed (the socket's replies come in by themselves);
        return how many requests are still pending."""
        self._core.check_usable()
        if self._core.reap_ring():
            self._release_held()
        return len(self._core.pending)

    # --- how this client waits: awaiting ----------------------------------------------------
    def _run(self, op: Op[T], timeout: float | None = None) -> Any:
        return self._drive(op, timeout)

    async def _drive(self, op: Op[T], timeout: float | None) -> T:
        """Run an operation, awaiting each request it yields."""
        deadline = math.inf if timeout is None else trio.current_time() + timeout
        failed: BaseException | None = None
        while True:
            try:
                p = op.throw(failed) if failed is not None else op.send(None)
            except StopIteration as stop:
                await trio.lowlevel.checkpoint()
                return stop.value  # type: ignore[no-any-return]
            failed = None
            try:
                await self._wait(p, None if deadline == math.inf else max(0.0, deadline - trio.current_time()))
            except BaseException as exc:  # thrown in: the operation may clean up (and re-raises)
                failed = exc

    async def _wait(self, p: Pending, timeout: float | None) -> None:
        if self._batch:  # requests held back by batch() must leave before we can wait on them
            reqs, self._batch = self._batch, []
            self._send(reqs)
        link = self._core.ring
        if not p._done and link is not None and p.id in link.outstanding:
            # On the ring, the answer is usually microseconds away: reap it here rather than
            # hop through the reaper task (two task switches and a doorbell).
            until = time.perf_counter() + _SPIN_S
            while not p._done and time.perf_counter() < until:
                if link.ring.available() and self._core.reap_ring():
                    self._release_held()
        if p._done:
            await trio.lowlevel.checkpoint()
            return
        if p._waker is None:
            p._waker = trio.Event()
        if timeout is None:
            await p._waker.wait()
        else:
            with trio.move_on_after(timeout):
                await p._waker.wait()
        if not p._done:
            raise E.RequestTimeout(f"no reply within {timeout}s")

    # --- how this client moves bytes: queued for the tasks ----------------------------------
    def _send(self, reqs: Sequence[P.Request]) -> None:
        self._held.extend(reqs)
        self._release_held()

    def _release_held(self) -> None:
        """Hand held requests, in order, to the ring or the socket as far as credits go."""
        held, core = self._held, self._core
        if not held:
            return
        pending = core.pending
        unsent = sum(1 for r in held if r.id in pending) + len(self._batch or ())
        while held:
            link = core.ring
            if link is not None and core.ring_route([held[0]], unsent):
                n, used, room = 0, 0, link.room
                while n < len(held) and link.takes(held[n]) and used + descriptors_of(held[n]) <= room:
                    used += descriptors_of(held[n])
                    n += 1
                if n == 0:
                    return  # the ring is full: the reaper calls again as completions come
                chunk = [held.popleft() for _ in range(n)]
                self._push(link, chunk)
                self._ring_kick.set()
            else:
                room = core.socket_room(unsent)
                if room <= 0:
                    return  # out of credits: replies call again
                chunk = [held.popleft() for _ in range(min(room, len(held)))]
                for frame in core.encode(chunk):
                    self._pump.send_nowait([frame])
                    self.frames_sent += 1
            unsent -= sum(1 for r in chunk if r.id in pending)

    def _push(self, link: RingLink, chunk: list[P.Request]) -> None:
        def full(need: int) -> None:
            raise AssertionError("pushed beyond the ring's credits")

        try:
            link.push(chunk, self._core.pending, full)
        except E.TransferError as exc:  # a field out of range: those requests fail, nothing else
            for r in chunk:
                if r.id not in link.outstanding:
                    p = self._core.pending.pop(r.id, None)
                    if p is not None:
                        p._finish(None, exc)
                        self._core.unobserved.append(p)

    def _on_message(self, parts: list[bytes]) -> None:
        self._last_rx = time.monotonic()
        for part in parts:
            self._core.on_frame(part)
        self._release_held()

    _completion_bell = True

    def _link(self, info: dict[str, Any]) -> RingLink:
        link = RingLink(info, self._core.shm_dir, self._core.collect, completion_bell=True)
        assert self._bg_nursery is not None
        self._bg_nursery.start_soon(self._reap_ring, link)
        return link

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
        """Finish ring requests as completions come: reap; if none, arm the completion
        inbox, re-check (the daemon's push either sees the armed word and rings the
        FIFO, or our re-check sees its completion), then sleep until the FIFO is readable."""
        core, ring = self._core, link.ring
        while core.broken is None:
            if core.reap_ring():
                self._release_held()
                await trio.lowlevel.checkpoint()
                continue
            if not link.outstanding:
                self._ring_kick = trio.Event()
                await self._ring_kick.wait()
                continue
            # A short spin first: a completion due within microseconds costs no doorbell,
            # no epoll round and no wakeup (the daemon's worker answers most that fast).
            until = time.perf_counter() + _SPIN_S
            while not ring.available() and time.perf_counter() < until:
                pass
            if ring.arm():
                ring.disarm()
                continue
            if ring.peer_closed:
                core.ring_closed()
                return
            # No timeout needed: the daemon holds the pipe's only write end, so its end of the
            # session (or its death) makes the pipe readable with EOF; `_liveness` covers the rest.
            await trio.lowlevel.wait_readable(link.cbell_fd)
            gone = link.drain_bell()
            ring.disarm()
            if gone:  # the daemon closed its end: the session ended, or the daemon died
                core.reap_ring()
                if ring.peer_closed:
                    core.ring_closed()
                else:
                    core.fail_all(E.ConnectionLost(f"the daemon (pid {core.server_pid}) closed the ring's doorbell"))
                return

    async def _liveness(self) -> None:
        while True:
            await trio.sleep(self._core.heartbeat_s)
            if time.monotonic() - self._last_rx > self._liveness_timeout:
                self._core.fail_all(E.ConnectionLost(f"the daemon at {self.endpoint} has not answered for {self._liveness_timeout}s"))
                return
            self._send([self._core.ping()])

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
    max_inflight: int = 1 << 16,
    watch_daemon_pid: bool = True,
    server_key: Any = None,
    client_keys: Any = None,
    deferred: bool = True,
    ring: bool | int | None = None,
) -> AsyncIterator[TrioClient]:
    """A trio session with the daemon (the arguments are `transfer.connect`'s); everything
    it holds is released on exit. A failing request raises its own exception out of the
    block, never an ExceptionGroup wrapping it."""
    endpoint = endpoint or os.environ.get("TRANSFER_ENDPOINT") or default_endpoint()
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
                    await client._run(client._op_hello(name, deferred), connect_timeout)
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
                        bg.start_soon(client._watch_daemon, os.pidfd_open(client.server_pid))
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
