"""The control sockets' connections: at most the fd budget's share, and none idle for long.

libzmq accepts every connection a ROUTER's listener sees, and aborts the whole
process when an accept finds no free descriptor (ipc_listener.cpp,
tcp_listener.cpp). So the daemon watches its sockets' accepts (a zmq monitor
each) and shuts down any connection beyond `limit`, the fd budget's share for
connections (`_config.fd_budget`); and a connection that carries no live
session and has said nothing for `idle_s` (it never said hello, or its session
ended) is shut down too, so idle connections cannot hold the cap against new
clients. A connection with a live session is never closed here: its session's
own timeout ends it, and then its connection goes idle_s after its last word.
A zmq client whose connection was closed reconnects by itself when it next
sends.

Closing is a `shutdown` of a duplicate of libzmq's descriptor: libzmq reads
EOF and closes its own end (its DISCONNECTED event drops the connection here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Callable

import trio
import zmq

from ..transport._zmq import SocketPump, monitor_socket, stop_monitor

__all__ = ["ConnectionGuard"]

log = logging.getLogger("transfer.daemon")


class ConnectionGuard:
    """The connections of one or more ROUTER sockets, under one cap."""

    def __init__(self, limit: int, idle_s: float, has_session: Callable[[bytes], bool]) -> None:
        self.limit = limit
        self.idle_s = idle_s
        #: Whether an identity (with its socket's prefix) has a live session.
        self._has_session = has_session
        #: Open connections: descriptor -> (accepted at, the socket's prefix, its pump's `seen`).
        self._open: dict[int, tuple[float, bytes, dict[int, tuple[float, bytes]]]] = {}
        self.counters = {"connections_refused": 0, "connections_idle_closed": 0}
        self._watched: list[tuple[zmq.Socket[bytes], zmq.Socket[bytes], bytes, dict[int, tuple[float, bytes]]]] = []

    def watch(self, sock: zmq.Socket[bytes], prefix: bytes, seen: dict[int, tuple[float, bytes]]) -> None:
        """Watch a socket's accepts from now on: call before it binds, so none is missed.
        `prefix`: its sessions' identity prefix; `seen`: its pump's table (`SocketPump(seen=)`)."""
        monitor = monitor_socket(sock, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self._watched.append((sock, monitor, prefix, seen))

    def close(self) -> None:
        """Stop the monitors (before their sockets close)."""
        for sock, monitor, _, _ in self._watched:
            with contextlib.suppress(zmq.ZMQError):
                stop_monitor(sock)
            monitor.close(0)
        self._watched.clear()

    async def run(self) -> None:
        """Keep the watched sockets' connections under the cap until cancelled."""
        async with trio.open_nursery() as nursery:
            for _, monitor, prefix, seen in self._watched:
                nursery.start_soon(self._events, monitor, prefix, seen)
            while True:
                await trio.sleep(self.idle_s / 4)
                self.sweep()

    async def _events(self, monitor: zmq.Socket[bytes], prefix: bytes, seen: dict[int, tuple[float, bytes]]) -> None:
        def on_event(parts: list[bytes]) -> None:
            if len(parts) != 2 or len(parts[0]) != 6:
                return
            event, fd = int.from_bytes(parts[0][:2], "little"), int.from_bytes(parts[0][2:], "little")
            if event == zmq.EVENT_DISCONNECTED:
                self._open.pop(fd, None)
                seen.pop(fd, None)
            elif event == zmq.EVENT_ACCEPTED:
                seen.pop(fd, None)  # (a descriptor number used again: a new connection)
                if len(self._open) < self.limit:
                    self._open[fd] = (time.monotonic(), prefix, seen)
                    return
                self.counters["connections_refused"] += 1
                refused = self.counters["connections_refused"]
                if refused == 1 or refused % 1000 == 0:
                    log.warning("%d connections open (the limit): closing new ones (%d so far)", len(self._open), refused)
                _shut(fd)

        await SocketPump(monitor).run(on_event)

    def sweep(self) -> None:
        """Shut down connections with no live session, silent for idle_s."""
        now = time.monotonic()
        for fd, (accepted, prefix, seen) in list(self._open.items()):
            last, identity = seen.get(fd, (accepted, b""))
            if identity and self._has_session(prefix + identity):
                continue
            if now - max(accepted, last) > self.idle_s:
                self.counters["connections_idle_closed"] += 1
                del self._open[fd]  # (its DISCONNECTED event finds it gone)
                _shut(fd)


def _shut(fd: int) -> None:
    """Shut libzmq's connection down: it reads EOF and closes its end."""
    try:
        s = socket.socket(fileno=os.dup(fd))  # a dup: libzmq keeps (and closes) its own
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()
