"""ZeroMQ on an asyncio loop, for a client's DEALER socket.

`zmq.FD` is edge-triggered (transport._zmq says why that matters): it signals
that `zmq.EVENTS` *may* have changed, and any send or recv can consume that
edge. So one callback, `AsyncioPump._pump`, does all receiving: the loop calls
it when the FD turns readable (`loop.add_reader`), and `send_nowait` schedules
it after every send, because the send may have eaten the edge of a reply. It
reads `zmq.EVENTS` before it returns (the moment it starts waiting) and loops
while anything is ready, so a message can never sit unseen. No task: a reply
is delivered from the loop's own callback, one hop shorter than a pump task.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable, cast

import zmq

__all__ = ["AsyncioPump"]

#: Messages received per pass before the loop runs other callbacks (fairness).
_RECV_BURST = 256
_NOBLOCK, _EVENTS, _POLLIN, _POLLOUT = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)


class AsyncioPump:
    """The single owner of a zmq socket on an asyncio loop.

    `on_message` gets each incoming multipart message, synchronously, from a loop
    callback; `on_error` gets what the socket raised (the pump has stopped then).
    """

    def __init__(self, sock: zmq.Socket[bytes], loop: asyncio.AbstractEventLoop, on_message: Callable[[list[bytes]], None],
                 on_error: Callable[[BaseException], None]) -> None:
        self.sock = sock
        self._fd = sock.fileno()  # zmq.FD
        self._loop = loop
        self._on_message = on_message
        self._on_error = on_error
        self._out: deque[list[bytes]] = deque()
        self._scheduled = False
        self._closed = False
        loop.add_reader(self._fd, self._pump)

    def send_nowait(self, parts: list[bytes]) -> None:
        """Send a multipart message now (queued, in order, if zmq cannot take it yet)."""
        if self._closed:
            return
        if not self._out:
            try:
                self.sock.send_multipart(parts, _NOBLOCK)
            except zmq.Again:
                self._out.append(parts)
            except zmq.ZMQError as exc:
                self._fail(exc)
                return
        else:
            self._out.append(parts)
        self._schedule()  # the send may have consumed the FD's edge: look at EVENTS soon

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        """Flush what waits to go out, deliver what came in, until EVENTS says nothing is ready."""
        self._scheduled = False
        if self._closed:
            return
        sock, out = self.sock, self._out
        events_of = cast("Callable[[int], int]", sock.getsockopt)  # EVENTS is an int option
        try:
            while True:
                while out:
                    try:
                        sock.send_multipart(out[0], _NOBLOCK)
                    except zmq.Again:
                        break
                    out.popleft()
                received = 0
                # Ask EVENTS rather than catching zmq.Again: raising it costs more than a recv.
                while events_of(_EVENTS) & _POLLIN:
                    if received == _RECV_BURST:
                        self._schedule()  # more waits: let other callbacks run first
                        return
                    self._on_message(sock.recv_multipart(_NOBLOCK))
                    received += 1
                    if self._closed:
                        return
                events = events_of(_EVENTS)
                if not (events & _POLLIN or (out and events & _POLLOUT)):
                    return  # EVENTS read last: the FD signals the next change
        except zmq.ZMQError as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.close()
        self._on_error(exc)

    def close(self) -> None:
        """Stop watching the socket (before it closes: its FD dies with it)."""
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self._fd)
