"""Remote sessions' data channels: their rings, carried over TCP (docs/ring.md, "Remote rings").

A session on another host cannot map the daemon's ring, so `OpenChannel` makes the ring
in the daemon's memory, starts its worker as for any ring, and answers with this daemon's
channel port and a random one-time key. The client connects, and its hello (session id
and key, `transfer.ring._channel.HELLO`) proves it: the key travelled on the session's
CURVE socket, so only that client holds it. From then on a native bridge (native/bridge.c)
pushes what arrives into the ring and sends the completions back, without the event loop.

The listener is bounded like every other: at most CHANNEL_WAITING connections may be in
their handshake at once (one more is closed as it is accepted), each has
HANDSHAKE_TIMEOUT_S to send its hello, a hello that proves nothing is closed without an
answer, and a key is good for one connection, for as long as its session lives.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass
from typing import Any

import trio

from .. import errors as E
from .. import _results as R
from ..ring._channel import ACK, HELLO, KEY_BYTES, Channel, parse_hello
from ..transport._zmq import tcp_host
from ._config import CHANNEL_WAITING, DaemonConfig
from ._rings import Rings
from ._session import Session

__all__ = ["Channels", "Awaited", "HANDSHAKE_TIMEOUT_S"]

log = logging.getLogger("transfer.server")

#: Seconds a new data-channel connection has to send its hello.
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass
class Awaited:
    """A session's data channel before its connection: the ring's memfd (the bridge maps
    it) and the key its hello must hold. Closed with the session, as a Channel is."""

    fd: int
    key: bytes

    def close(self, reason: int = 1) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Channels:
    """The channel listener and the sessions waiting for their connection."""

    def __init__(self, config: DaemonConfig, rings: Rings) -> None:
        self.config = config
        self.rings = rings
        self.listener: Any = None
        #: The port channels connect to (0: no listener, no channels).
        self.port = 0
        self.handshaking = 0
        self.counters = {"channels_opened": 0, "channels_refused": 0, "channels_busy": 0}

    def bind(self) -> None:
        """Listen on the tcp endpoint's host (`--channel-port`, or any free port); a daemon
        without a tcp endpoint has no channels."""
        host = tcp_host(self.config.endpoints)
        if host is None or not self.config.rings:
            return
        sock = None
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host or None, self.config.channel_port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(CHANNEL_WAITING)
        except BaseException as exc:
            if sock is not None:
                sock.close()
            if isinstance(exc, OSError):
                raise RuntimeError(f"cannot listen for data channels on {host or '*'}:{self.config.channel_port} "
                                   f"(--channel-port; 0 takes any free port): {exc}") from None
            raise
        self.port = sock.getsockname()[1]
        self.listener = trio.socket.from_stdlib_socket(sock)

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def open(self, session: Session, capacity: int, nursery: trio.Nursery) -> R.ChannelOpened:
        """OpenChannel: the session's ring, served from now on, and the key its connection shows."""
        if not self.config.rings:
            raise E.RingUnavailable("request rings are disabled on this daemon (--no-rings)")
        if self.listener is None:
            raise E.RingUnavailable("this daemon has no tcp endpoint: data channels are for clients on other hosts")
        cap = self.rings.capacity(session, capacity)
        ring, fd = self.rings.create(session, cap)
        key = secrets.token_bytes(KEY_BYTES)
        session.channel = Awaited(fd, key)
        try:
            self.rings.install(session, ring, nursery)
        except BaseException:
            self.rings.close(session)  # (the ring, its memfd and whatever started)
            raise
        return R.ChannelOpened(key, self.port, ring.request_capacity, ring.completion_capacity, graphs=True, after=True)

    async def serve(self) -> None:
        """Accept connections; each proves its session within the handshake's time, or goes."""
        if self.listener is None:
            return
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    conn, _ = await self.listener.accept()
                except OSError as exc:  # EMFILE and friends: back off, never spin
                    log.warning("data channels: accept failed: %s", exc)
                    await trio.sleep(0.05)
                    continue
                if self.handshaking >= CHANNEL_WAITING:
                    conn.close()
                    self.counters["channels_busy"] += 1
                    continue
                self.handshaking += 1
                nursery.start_soon(self._handshake, conn)

    def _awaited(self, session_id: int) -> tuple[Session, Awaited] | None:
        session = self.rings.sessions.get(session_id)
        if session is None or not session.running or not isinstance(session.channel, Awaited):
            return None
        return session, session.channel

    async def _handshake(self, conn: Any) -> None:
        try:
            sid: int | None = None
            with trio.move_on_after(HANDSHAKE_TIMEOUT_S) as timer:
                data = b""
                while len(data) < HELLO.size:
                    chunk = await conn.recv(HELLO.size - len(data))
                    if not chunk:
                        break
                    data += chunk
                sid = parse_hello(data, lambda s: None if (a := self._awaited(s)) is None else a[1].key)
                if sid is not None:
                    await conn.send(ACK)
            found = None if sid is None or timer.cancelled_caught else self._awaited(sid)  # (the session may have ended meanwhile)
            if found is None:
                self.counters["channels_refused"] += 1
                log.warning("a data-channel connection proved no session waiting for one: closed")
                return
            session, awaited = found
            session.channel = None
            try:
                session.channel = Channel(awaited.fd, "client", socket.socket(fileno=conn.detach()), 1,
                                          bell=self.rings.loop.doorbell().write_fd, spin=self.config.worker_spin_s)
            except (OSError, ValueError, RuntimeError) as exc:  # (the client reads EOF: its ring closes)
                log.warning("session %d: cannot serve its data channel: %s", session.id, exc, extra={"session": session.id})
                return
            finally:
                awaited.close()
            self.counters["channels_opened"] += 1
            log.info("session %d: data channel connected", session.id, extra={"session": session.id})
        except OSError as exc:  # the peer reset the connection mid-handshake
            self.counters["channels_refused"] += 1
            log.warning("a data-channel handshake failed: %s", exc)
        finally:
            self.handshaking -= 1
            conn.close()
