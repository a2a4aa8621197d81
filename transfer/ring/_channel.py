"""A ring carried over a TCP connection: the data channel of a session on another host.

A remote client cannot map the daemon's memory, so each side keeps a ring in its own:
the client submits into its ring exactly as a same-host client does, and the daemon's
worker and Python pass serve the daemon's ring exactly as they serve a same-host one. A
native `Bridge` (native/bridge.c) on each side plays the far end of its local ring and
moves the slots over one TCP connection per session: request descriptors one way,
completions the other, as raw ring slots. Nothing in between trusts them: the daemon
checks every descriptor as it checks a local client's, the client every completion.

The connection is opened by the client after `OpenChannel` on the control socket (CURVE
on tcp): the daemon answers with a port and a random one-time key, and the client's first
32 bytes on the new connection are `HELLO` (magic, session id, key). The daemon answers
`ACK` and from then on the stream is slots. docs/security.md says what the channel trusts.
"""

from __future__ import annotations

import hmac
import socket
import struct
from typing import Any, Callable

from .._native import Bridge
from ._endpoint import Ring
from ._layout import OFF_CLIENT_CLOSED, OFF_SERVER_CLOSED

__all__ = ["Channel", "HELLO", "ACK", "MAGIC", "hello", "parse_hello"]

#: The channel's first bytes: its magic (with its version), the session and its key.
MAGIC = b"TRDCHAN1"
HELLO = struct.Struct("<8sQ16s")
#: The daemon's answer to a hello it accepts; it answers none other (it closes).
ACK = b"TRDCOK01"
KEY_BYTES = 16
#: How long a bridge's sender polls its queue before it sleeps on the futex (as a ring
#: worker's default): a request pushed meanwhile leaves without a wake-up.
SPIN_S = 50e-6


def hello(session: int, key: bytes) -> bytes:
    """What the client sends first on a new data channel."""
    return HELLO.pack(MAGIC, session, key)


def parse_hello(data: bytes, key_of: Callable[[int], bytes | None]) -> int | None:
    """The session a channel's first bytes prove, or None: the magic, a session that waits
    for its channel (`key_of` gives its key, None for any other), and that key (compared
    in constant time)."""
    if len(data) != HELLO.size:
        return None
    magic, session, key = HELLO.unpack(data)
    if magic != MAGIC:
        return None
    want = key_of(session)
    if want is None or not hmac.compare_digest(want, key):
        return None
    return int(session)


class Channel:
    """The far end of a local ring, served over a connected socket by a native bridge.

    `ring_fd`: the ring's memfd; `role`: the part the far end plays ("server" on the client,
    whose bridge consumes requests; "client" on the daemon, whose bridge consumes
    completions); `sock`: the connected socket, the bridge's from now on; `reason`: what
    the ring's user reads as its peer's close reason when the channel ends; `bell`: an fd
    to write a byte to when the bridge pushes to a consumer armed to sleep on it (-1: none);
    `spin`: how long its sender polls for slots before it sleeps.
    """

    def __init__(self, ring_fd: int, role: str, sock: socket.socket, reason: int, *, bell: int = -1, spin: float = SPIN_S) -> None:
        self.view = Ring.attach(ring_fd, role=role)
        try:
            if bell >= 0:
                self.view.set_doorbell(bell)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a slot leaves when pushed
            sock.setblocking(True)
            closed = OFF_SERVER_CLOSED if role == "server" else OFF_CLIENT_CLOSED
            self.bridge: Any = Bridge(self.view.inbox, self.view.outbox, sock.fileno(), closed, reason, spin)
        except BaseException:
            self.view.close()
            raise
        sock.detach()  # the bridge closes it

    @property
    def ended(self) -> bool:
        """The connection is gone (the ring's user sees its peer closed)."""
        return bool(self.bridge.ended)

    def counters(self) -> dict[str, int]:
        return dict(self.bridge.counters())

    def close(self, reason: int = 1) -> None:
        """End the channel, join the bridge's threads, unmap the view."""
        self.bridge.stop()
        self.view.close(reason)
