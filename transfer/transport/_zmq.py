"""ZeroMQ under trio.

pyzmq has no trio integration, and `zmq.FD` is edge-triggered: it signals
that `zmq.EVENTS` *may* have changed, and any send or recv can consume that
edge. So the socket is touched only by `SocketPump`: its task (`run`), and
`send_nowait` while that task is parked. Before every wait the task reads
`zmq.EVENTS` and loops while anything is ready; `send_nowait` sends what is
queued and, having read `zmq.EVENTS` after the send, rings the task's bell
when anything is ready for it. A message can therefore never sit unseen.

The task parks on one epoll set holding the socket's FD and that bell (an
eventfd): ringing it is a write, where cancelling a wait (the other way to
wake a trio task) costs a cancel scope per wait and an exception per wake,
~20 us of the loop's thread per message on a 2-core VM.
Linux only, as the rest of the package.
"""

from __future__ import annotations

import errno
import os
import select
import time
from collections import deque
from pathlib import Path
from typing import Callable, Sequence, TypeVar, cast
from urllib.parse import urlparse

import trio
import zmq

__all__ = ["SocketPump", "monitor_socket", "stop_monitor", "ipc_path", "check_endpoint", "endpoint_error", "default_endpoint", "resolve_endpoint", "tcp_host"]

#: Messages received per pass before yielding to other tasks (fairness).
_RECV_BURST = 256
#: How often parked replies are retried while a peer's pipe is full.
_BACKLOG_RETRY_S = 0.005
# Plain ints: pyzmq's flag enums cost a Python-level __and__ on every use.
_NOBLOCK, _EVENTS, _POLLIN, _POLLOUT = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_SRCFD = int(zmq.SRCFD)


class SocketPump:
    """The single owner of a zmq socket inside a trio program.

    For a ROUTER with a finite SNDHWM (and ROUTER_MANDATORY), a peer that does not
    read fills its pipe and sends to it fail with EAGAIN: its messages are parked in
    a backlog of its own, so one slow peer never holds up the others, and a backlog
    past `max_backlog` bytes is dropped and reported to `on_overflow(identity)`.
    """

    def __init__(self, sock: zmq.Socket[bytes], *, max_backlog: int = 0, on_overflow: Callable[[bytes], None] | None = None,
                 seen: dict[int, tuple[float, bytes]] | None = None) -> None:
        self.sock = sock
        #: When given (a ROUTER): the connection (its descriptor, `zmq.SRCFD`) each message
        #: came from -> (when, time.monotonic(); the peer's identity), for a guard that
        #: closes idle connections. Reading the source costs the message's frames as
        #: zmq.Frame objects: ~1.5 us a message.
        self.seen = seen
        self._fd = sock.fileno()  # zmq.FD
        self._out: deque[list[bytes]] = deque()
        #: While the task is parked: the eventfd that wakes it (`_ring`); else None.
        self._bell: int | None = None
        self._rung = False
        #: Set up by `wait_drained` (a wait for every queued message to be handed to zmq).
        self._drained: trio.Event | None = None
        self.dropped = 0  # replies to peers that have gone away
        #: Per-peer backlogs (ROUTER): identity -> (messages, bytes).
        self._parked: dict[bytes, tuple[deque[list[bytes]], list[int]]] = {}
        self.max_backlog = max_backlog
        self.on_overflow = on_overflow
        self.overflows = 0

    def send_nowait(self, parts: list[bytes]) -> None:
        """Queue a multipart message; the pump sends it on its next pass, or at once when
        the pump is parked waiting for the socket: the same flush, then `EVENTS` read, as
        after every send, and the pump woken only if zmq has something for it (a message,
        or one that could not go yet)."""
        self._out.append(parts)
        if self._bell is not None:
            self._flush()
            if self._out or self._parked or int(self.sock.getsockopt(_EVENTS)) & _POLLIN:
                self._ring()

    def _ring(self) -> None:
        if not self._rung and self._bell is not None:
            self._rung = True
            os.eventfd_write(self._bell, 1)

    async def wait_drained(self) -> None:
        """Until every queued message has been handed to zmq (or dropped with its peer)."""
        if not self._out and not self._parked:
            await trio.lowlevel.checkpoint()
            return
        if self._drained is None:
            self._drained = trio.Event()
        await self._drained.wait()

    def backlog(self, identity: bytes) -> int:
        """Bytes parked for one peer (replies it has not made room for)."""
        entry = self._parked.get(identity)
        return entry[1][0] if entry is not None else 0

    def _send(self, parts: list[bytes]) -> bool:
        """One message; False when the peer's pipe is full (EAGAIN)."""
        try:
            self.sock.send_multipart(parts, _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            self.dropped += 1  # ROUTER_MANDATORY: that peer is gone
        return True

    def _park(self, parts: list[bytes]) -> None:
        ident = parts[0]
        entry = self._parked.get(ident)
        if entry is None:
            entry = self._parked[ident] = (deque(), [0])
        entry[0].append(parts)
        entry[1][0] += sum(len(p) for p in parts)
        if self.max_backlog and entry[1][0] > self.max_backlog:
            del self._parked[ident]
            self.overflows += 1
            if self.on_overflow is not None:
                self.on_overflow(ident)

    def _flush(self) -> None:
        out, parked = self._out, self._parked
        for ident in list(parked):  # older messages first: a peer's order is kept
            msgs, size = parked[ident]
            while msgs:
                if not self._send(msgs[0]):
                    break
                size[0] -= sum(len(p) for p in msgs.popleft())
            if not msgs:
                del parked[ident]
        while out:
            parts = out.popleft()
            if (parts[0] in parked if parked else False) or not self._send(parts):
                self._park(parts)
        self._check_drained()

    def _check_drained(self) -> None:
        if self._drained is not None and not self._out and not self._parked:
            self._drained.set()
            self._drained = None

    async def run(self, on_message: Callable[[list[bytes]], None]) -> None:
        """Pump forever: flush outgoing, deliver incoming to `on_message` (synchronous)."""
        sock = self.sock
        events_of = cast("Callable[[int], int]", sock.getsockopt)  # EVENTS is an int option
        bell = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        waits = select.epoll()  # (level-triggered: readable while the FD or the bell is)
        try:
            waits.register(self._fd, select.EPOLLIN)
            waits.register(bell, select.EPOLLIN)
            while True:
                self._flush()
                received = 0
                # Ask EVENTS rather than catching zmq.Again: raising it costs more than a recv.
                # (Each read costs microseconds, pyzmq converting the option per call: the last
                # one of the burst also decides what comes next.)
                events = events_of(_EVENTS)
                seen = self.seen
                while events & _POLLIN and received < _RECV_BURST:
                    if seen is None:
                        on_message(sock.recv_multipart(_NOBLOCK))
                    else:
                        frames = sock.recv_multipart(_NOBLOCK, copy=False)
                        parts = [f.bytes for f in frames]
                        seen[frames[-1].get(_SRCFD)] = (time.monotonic(), parts[0])
                        on_message(parts)
                    received += 1
                    events = events_of(_EVENTS)
                if received == _RECV_BURST:
                    await trio.sleep(0)
                    continue
                if events & _POLLIN or (self._out and events & _POLLOUT):
                    continue
                self._bell = bell
                try:
                    if self._parked:
                        # A ROUTER says nothing when a peer's pipe drains: look again soon.
                        with trio.move_on_after(_BACKLOG_RETRY_S):
                            await trio.lowlevel.wait_readable(waits.fileno())
                    else:
                        await trio.lowlevel.wait_readable(waits.fileno())
                finally:
                    self._bell = None
                if self._rung:
                    self._rung = False
                    os.eventfd_read(bell)
        finally:
            waits.close()
            os.close(bell)


def monitor_socket(sock: zmq.Socket[bytes], events: int, addr: str | None = None) -> zmq.Socket[bytes]:
    """`sock.get_monitor_socket(events, addr)`, retried when a signal interrupts it.

    pyzmq retries its send, recv, bind and poll calls on EINTR but not zmq_socket_monitor,
    whose inproc bind can see one: a SIGTERM landing as a daemon starts would otherwise
    crash it (rc 1) instead of draining it. A failed try leaves no monitor behind (libzmq
    fails the bind before it registers anything), so trying again is safe."""
    return _retried(lambda: sock.get_monitor_socket(events, addr))


def stop_monitor(sock: zmq.Socket[bytes]) -> None:
    """`sock.disable_monitor()`, retried when a signal interrupts it (as `monitor_socket`)."""
    _retried(sock.disable_monitor)


_T = TypeVar("_T")


def _retried(call: Callable[[], _T]) -> _T:
    """`call()` again for as long as a signal interrupts it (zmq.InterruptedSystemCall)."""
    while True:
        try:
            return call()
        except zmq.InterruptedSystemCall:
            continue


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


def endpoint_error(endpoint: object) -> str | None:
    """Why `endpoint` is not one transfer can use (None if it is): the one syntax check
    that the daemon's settings and the clients share, before zmq's bare "Invalid argument"."""
    if not isinstance(endpoint, str):
        return f"{endpoint!r} ({type(endpoint).__name__}) is not a string: an endpoint is ipc://PATH or tcp://HOST:PORT"
    if not endpoint:
        return "the endpoint is empty: give ipc://PATH or tcp://HOST:PORT, or None for the default"
    if endpoint.startswith("ipc://"):
        path = endpoint[len("ipc://"):]
        if not path:
            return "ipc:// needs a socket path (ipc:///run/transfer/transferd.sock)"
        if not path.startswith("/"):
            return (f"{endpoint!r} names the relative path {path!r}, looked for below the current directory: "
                    f"three slashes for an absolute one (ipc:///{path})")
        return None
    if endpoint.startswith("tcp://"):
        rest = endpoint[len("tcp://"):]
        host, sep, port = rest.rpartition(":")
        if not (host and sep and port.isdigit()):
            return f"{endpoint!r} is not tcp://HOST:PORT"
        return None
    scheme, sep, _ = endpoint.partition("://")
    if sep:
        return f"{endpoint!r} is not ipc://PATH or tcp://HOST:PORT (unknown scheme {scheme!r})"
    return f"{endpoint!r} is not ipc://PATH or tcp://HOST:PORT (the scheme is required)"


def tcp_host(endpoints: Sequence[str]) -> str | None:
    """The host of the first tcp:// endpoint ("" for every interface), or None: no tcp."""
    for ep in endpoints:
        if ep.startswith("tcp://"):
            host = ep[len("tcp://"):].rpartition(":")[0]
            return "" if host == "*" else host.strip("[]")
    return None


def resolve_endpoint(endpoint: object) -> str:
    """A client's endpoint: the one given (checked), else $TRANSFER_ENDPOINT, else the
    per-user default. ValueError (TypeError for a non-string) says what is wrong."""
    if endpoint is None:
        return os.environ.get("TRANSFER_ENDPOINT") or default_endpoint()
    why = endpoint_error(endpoint)
    if why is not None:
        raise (ValueError if isinstance(endpoint, str) else TypeError)(f"bad endpoint: {why}")
    assert isinstance(endpoint, str)
    return endpoint


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
