"""The metrics endpoint's HTTP listener: one thread, a bounded number of connections, each with a deadline.

Anyone on the host can connect to the metrics port, and every descriptor the daemon
holds for them is one libzmq cannot get (it aborts the daemon when an accept finds
none). So nothing here is held at a client's pleasure:

* at most `max_connections` are open at once; one accepted beyond is answered 503
  (if its empty send buffer takes it at once) and closed;
* each is closed `timeout_s` after its accept, whatever it sent or read (silent,
  trickling and never-reading clients alike);
* one thread runs a selector over non-blocking sockets: no thread per connection;
* one request per connection (HTTP/1.0, `Connection: close`), its head at most
  `MAX_HEAD` bytes: GET or HEAD of `/metrics` or `/`;
* the exposition is rendered on this thread, never on the daemon's trio thread;
* an accept that fails for want of descriptors pauses accepting briefly, not spinning.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from prometheus_client import generate_latest
from prometheus_client.registry import Collector

__all__ = ["MetricsHTTP", "DEFAULT_MAX_CONNECTIONS", "DEFAULT_TIMEOUT_S", "MAX_HEAD"]

DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_TIMEOUT_S = 5.0
#: Longest request head (request line and headers) read; longer gets 431.
MAX_HEAD = 8192
#: Connections the kernel queues before an accept. They hold no descriptor of ours, so the
#: queue can be deep enough that a burst of connects is not dropped into SYN retransmits.
BACKLOG = 64
#: How long accepting pauses after an accept error (EMFILE, ENFILE, ENOBUFS...).
ACCEPT_PAUSE_S = 0.1
#: What `generate_latest` writes: the classic text format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger("transfer.metrics")


def _response(status: str, body: bytes | None = None, content_type: str = "text/plain; charset=utf-8", *, head_only: bool = False, extra: str = "") -> bytes:
    """A whole HTTP/1.0 response; the body defaults to the status line's text."""
    body = (status.split(" ", 1)[1] + "\n").encode() if body is None else body
    top = f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n"
    return top.encode() + (b"" if head_only else body)


_BUSY = _response("503 Service Unavailable")


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    fd: int
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    out: memoryview | None = None  # the response not yet sent, once the head is in


class MetricsHTTP:
    """Serve `registry`'s exposition on addr:port; `start()` binds and returns the port, `stop()` ends it.

    Counters, readable from any thread: `accepted` (every connection accepted, refused
    ones included), `refused` (closed at once: the cap was reached), `timed_out` (closed
    at their deadline), `accept_errors` (accepts that failed and paused accepting)."""

    def __init__(self, registry: Collector, port: int, addr: str = "127.0.0.1", *, max_connections: int = DEFAULT_MAX_CONNECTIONS, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if max_connections < 1 or not timeout_s > 0:
            raise ValueError(f"max_connections must be >= 1 and timeout_s > 0, not {max_connections} and {timeout_s}")
        self.registry = registry
        self.max_connections, self.timeout_s = max_connections, timeout_s
        self.accepted = self.refused = self.timed_out = self.accept_errors = 0
        self._conns: dict[int, _Conn] = {}  # fd -> connection, in accept order: so in deadline order
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        self._sockaddr: tuple[Any, ...] = sockaddr
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._sel = selectors.DefaultSelector()
        self._wake = socket.socketpair()
        self._paused_until = 0.0  # accepting is paused until then (0: not paused)
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Bind and listen (OSError if the port is taken), start the thread; return the bound port."""
        if self._thread is not None:
            raise RuntimeError("metrics HTTP listener already started")
        listener = self._listener
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(self._sockaddr)
            listener.listen(BACKLOG)
        except OSError:
            self._close_all()
            raise
        for sock in (listener, *self._wake):
            sock.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, self._accept)
        self._sel.register(self._wake[0], selectors.EVENT_READ, self._woken)
        self._thread = threading.Thread(target=self._run, name="transfer-metrics-http", daemon=True)
        self._thread.start()
        return int(listener.getsockname()[1])

    def stop(self) -> None:
        """Wake the thread, wait for it, and close every socket (a listener never started: its sockets)."""
        if self._thread is not None:
            self._stopping = True
            with contextlib.suppress(OSError):
                self._wake[1].send(b"\0")
            self._thread.join()
            self._thread = None
        self._close_all()

    @property
    def connections(self) -> int:
        """Connections open now."""
        return len(self._conns)

    # --- the listener's thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._sel.select(self._wait()):
                    if isinstance(key.data, _Conn):
                        self._io(key.data)
                    else:  # the listener or the wake-up socket
                        key.data()
                self._tick()
        except Exception:  # a bug here must not leave a listener that accepts into its backlog
            log.exception("metrics HTTP listener failed; the endpoint is closed")
        finally:
            self._close_all()

    def _close_all(self) -> None:
        for c in list(self._conns.values()):
            self._close(c)
        self._sel.close()
        for sock in (self._listener, *self._wake):
            sock.close()

    def _wait(self) -> float | None:
        """Seconds until the next deadline or the end of an accept pause (None: no such thing)."""
        ends = [self._paused_until] if self._paused_until else []
        if self._conns:
            ends.append(next(iter(self._conns.values())).deadline)
        return max(0.0, min(ends) - time.monotonic()) if ends else None

    def _tick(self) -> None:
        """Close the connections past their deadline; resume accepting after a pause."""
        now = time.monotonic()
        if self._paused_until and now >= self._paused_until:
            self._paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, self._accept)
        while self._conns and (c := next(iter(self._conns.values()))).deadline <= now:
            self.timed_out += 1
            self._close(c)

    def _woken(self) -> None:
        with contextlib.suppress(OSError):
            self._wake[0].recv(64)

    def _accept(self) -> None:
        for _ in range(16):  # then back to the selector, so deadlines and I/O go on under a flood
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.ECONNABORTED:  # EMFILE, ENFILE, ENOBUFS...: retrying now would spin
                    self._pause_accepting(exc)
                    return
                continue
            self._admit(sock)

    def _pause_accepting(self, exc: OSError) -> None:
        self.accept_errors += 1
        if self.accept_errors % 100 == 1:  # the first, then one in a hundred: a lasting shortage must not flood the log
            log.warning("metrics endpoint cannot accept (%s; %d times so far): pausing %.1f s", exc, self.accept_errors, ACCEPT_PAUSE_S)
        self._sel.unregister(self._listener)
        self._paused_until = time.monotonic() + ACCEPT_PAUSE_S

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.accepted += 1
        if len(self._conns) >= self.max_connections:
            self.refused += 1
            with contextlib.suppress(OSError):
                sock.send(_BUSY)
            sock.close()
            return
        c = _Conn(sock, sock.fileno(), time.monotonic() + self.timeout_s)
        self._conns[c.fd] = c
        self._sel.register(sock, selectors.EVENT_READ, c)

    def _io(self, c: _Conn) -> None:
        step: Callable[[_Conn], None] = self._read if c.out is None else self._write
        try:
            step(c)
        except BlockingIOError:
            pass
        except OSError:  # reset, broken pipe: the client is gone
            self._close(c)

    def _read(self, c: _Conn) -> None:
        data = c.sock.recv(MAX_HEAD - len(c.head))
        if not data:
            self._close(c)
            return
        c.head += data
        if b"\r\n\r\n" in c.head or b"\n\n" in c.head:
            c.out = memoryview(self._answer(bytes(c.head)))
        elif len(c.head) >= MAX_HEAD:
            c.out = memoryview(_response("431 Request Header Fields Too Large"))
        else:
            return
        self._sel.modify(c.sock, selectors.EVENT_WRITE, c)
        self._write(c)

    def _write(self, c: _Conn) -> None:
        assert c.out is not None
        c.out = c.out[c.sock.send(c.out) :]
        if not c.out:
            self._close(c)

    def _answer(self, head: bytes) -> bytes:
        parts = head.split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return _response("400 Bad Request")
        method, path = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _response("405 Method Not Allowed", extra="Allow: GET, HEAD\r\n")
        if path not in (b"/", b"/metrics"):
            return _response("404 Not Found")
        try:
            body = generate_latest(self.registry)
        except Exception:  # a collector's bug fails this scrape, not the listener
            log.exception("rendering the metrics exposition failed")
            return _response("500 Internal Server Error")
        return _response("200 OK", body, CONTENT_TYPE, head_only=method == b"HEAD")

    def _close(self, c: _Conn) -> None:
        if self._conns.pop(c.fd, None) is None:
            return
        self._sel.unregister(c.sock)
        c.sock.close()
