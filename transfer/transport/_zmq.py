"""ZeroMQ under trio.

pyzmq has no trio integration, and `zmq.FD` is edge-triggered: it signals
that `zmq.EVENTS` *may* have changed, and any send or recv can consume that
edge. So exactly one task (`SocketPump.run`) touches the socket. Other
tasks hand it outgoing messages with `send_nowait`, which wakes it by
cancelling its wait; before every wait it reads `zmq.EVENTS` and loops
while anything is ready. A message can therefore never sit unseen.
"""

from __future__ import annotations

import errno
import os
from collections import deque
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

import trio
import zmq

__all__ = ["SocketPump", "ipc_path", "check_endpoint", "default_endpoint"]

#: Messages received per pass before yielding to other tasks (fairness).
_RECV_BURST = 256
# Plain ints: pyzmq's flag enums cost a Python-level __and__ on every use.
_NOBLOCK, _EVENTS, _POLLIN, _POLLOUT = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)


class SocketPump:
    """The single owner of a zmq socket inside a trio program."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self._fd = sock.getsockopt(zmq.FD)
        self._out: deque[list[bytes]] = deque()
        self._wait_scope: trio.CancelScope | None = None
        self._drained = trio.Event()
        self._drained.set()
        self.dropped = 0  # replies to peers that have gone away

    def send_nowait(self, parts: list[bytes]) -> None:
        """Queue a multipart message; the pump sends it on its next pass."""
        self._out.append(parts)
        if self._drained.is_set():
            self._drained = trio.Event()
        if self._wait_scope is not None:
            self._wait_scope.cancel()

    async def wait_drained(self) -> None:
        """Until every queued message has been handed to zmq."""
        await self._drained.wait()

    def _flush(self) -> None:
        out, sock = self._out, self.sock
        while out:
            try:
                sock.send_multipart(out[0], _NOBLOCK)
            except zmq.Again:
                return  # peer's queue is full: wait for POLLOUT
            except zmq.ZMQError as exc:
                if exc.errno != errno.EHOSTUNREACH:
                    raise
                self.dropped += 1  # ROUTER_MANDATORY: that peer is gone
            out.popleft()
        self._drained.set()

    async def run(self, on_message: Callable[[list[bytes]], None]) -> None:
        """Pump forever: flush outgoing, deliver incoming to `on_message` (synchronous)."""
        sock = self.sock
        while True:
            self._flush()
            received = 0
            # Ask EVENTS rather than catching zmq.Again: raising it costs more than a recv.
            while received < _RECV_BURST and sock.getsockopt(_EVENTS) & _POLLIN:
                on_message(sock.recv_multipart(_NOBLOCK))
                received += 1
            if received == _RECV_BURST:
                await trio.sleep(0)
                continue
            events = sock.getsockopt(_EVENTS)
            if events & _POLLIN or (self._out and events & _POLLOUT):
                continue
            self._wait_scope = trio.CancelScope()
            try:
                with self._wait_scope:
                    await trio.lowlevel.wait_readable(self._fd)
            finally:
                self._wait_scope = None
            await trio.lowlevel.checkpoint_if_cancelled()


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def default_endpoint() -> str:
    """ipc socket in a private (0700) per-user directory."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return f"ipc://{base}/transferd-{os.geteuid()}/transferd.sock"


_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def check_endpoint(
    endpoint: str, *, allow_remote_tcp: bool = False, curve: bool = False, allow_insecure_tcp: bool = False
) -> str:
    """Validate an endpoint the daemon may bind.

    ipc://PATH always (the socket file is 0600 in a 0700 directory). tcp:// needs
    CURVE (`curve`: the daemon has keys, clients must hold an authorized key);
    without it, tcp is refused unless `allow_insecure_tcp`, and then only on
    loopback unless `allow_remote_tcp` too.
    """
    if endpoint.startswith("ipc://"):
        if not endpoint[6:]:
            raise ValueError("ipc:// endpoint needs a path")
        return endpoint
    if endpoint.startswith("tcp://"):
        if curve:
            return endpoint
        host = urlparse(endpoint).hostname or ""
        if host not in _LOOPBACK and not allow_remote_tcp:
            raise ValueError(
                f"refusing to bind {endpoint}: unauthenticated tcp is only allowed on loopback "
                "(give the daemon CURVE keys: transferd keygen DIR, then --curve-dir DIR)"
            )
        if not allow_insecure_tcp:
            raise ValueError(
                f"refusing to bind {endpoint} without authentication: make CURVE keys with "
                "`transferd keygen DIR` and pass --curve-dir DIR (or --allow-insecure-tcp, for tests on loopback)"
            )
        return endpoint
    raise ValueError(f"unsupported endpoint {endpoint!r} (use ipc://PATH or tcp://127.0.0.1:PORT)")
