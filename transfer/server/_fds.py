"""The daemon's fd socket: single-use tokens for sealed memfds (segments, rings).

The daemon never names shared memory by a path (a client could truncate any
file it can open for writing, and the daemon would die of SIGBUS on its next
access: `transfer.memory._shm`). A RegisterHost or OpenRing reply carries a
random token instead; the client connects to this socket, sends the token,
and receives the memfd (SCM_RIGHTS; wire in `transfer.transport._fds`).

What a peer of this socket can make the daemon do, and its bounds:

- The socket is ``transfer.<instance>.fds.<random>`` in the shm dir, mode 0600
  (the shm dir may be world-writable, so the name is unguessable, and a
  restarting daemon sweeps a dead instance's socket with its other files).
- A peer of another uid is refused at once (SO_PEERCRED). A token's memfd goes
  only to the process that opened its session (SO_PEERCRED pid, read through
  the peer's pid namespace) when the session named a pid; a token is deleted on
  use, with its segment, and with its session; a session may have at most
  `MAX_PER_SESSION` outstanding.
- Nothing here blocks the event loop: non-blocking trio sockets, one bounded
  read per connection, a deadline per connection (`TIMEOUT_S`), and at most
  `MAX_CONNECTIONS` at once: a new connection evicts the oldest, so peers that
  connect and say nothing cannot starve the ones that send their token at once.
"""

from __future__ import annotations

import array
import logging
import os
import secrets
import socket
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import trio

from .. import errors as E
from ..memory._shm import PREFIX
from ..transport._fds import OK, REFUSED, MAX_REPLY, TOKEN_BYTES, peer_credentials, unix_address
from ._session import Session

__all__ = ["FdChannel"]

log = logging.getLogger("transfer.server")


def _same_process(claimed: int, peer: int) -> bool:
    """Whether `claimed` (the pid a client gave in hello, in its own pid namespace) is `peer`
    (SO_PEERCRED, in ours): equal, or the innermost pid of the peer's NSpid line."""
    if claimed == peer:
        return True
    try:
        with open(f"/proc/{peer}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1]) == claimed
    except (OSError, ValueError):
        pass
    return False


class FdChannel:
    """Tokens -> memfds, and the Unix socket that redeems them."""

    #: Outstanding (not yet collected) memfds per session.
    MAX_PER_SESSION = 64
    #: Connections served at once; one more evicts the oldest.
    MAX_CONNECTIONS = 16
    #: Seconds a connection may take from accept to reply.
    TIMEOUT_S = 2.0

    def __init__(self, shm_dir: Path, instance: Callable[[], str]) -> None:
        self.shm_dir = shm_dir
        self._instance = instance
        self.path: Path | None = None
        self._listener: socket.socket | None = None
        #: token -> (session, memfd)
        self._offers: dict[bytes, tuple[Session, int]] = {}
        self._by_session: dict[int, set[bytes]] = {}
        self._conns: OrderedDict[int, trio.CancelScope] = OrderedDict()
        self._next_conn = 0
        self.counters = {"fds_passed": 0, "fds_refused": 0}

    # --- tokens (synchronous, on the trio thread) ----------------------------------------------
    def check_room(self, session: Session) -> None:
        n = len(self._by_session.get(session.id, ()))
        if n >= self.MAX_PER_SESSION:
            raise E.QuotaExceeded(f"session has {n} memory handles it has not collected from the fd socket (limit {self.MAX_PER_SESSION})")

    def offer(self, session: Session, fd: int) -> bytes:
        """Take `fd` (ours to close from now on) and return the token that redeems it once."""
        try:
            self.check_room(session)
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(TOKEN_BYTES)
        self._offers[token] = (session, fd)
        self._by_session.setdefault(session.id, set()).add(token)
        return token

    def revoke(self, token: bytes | None) -> None:
        """Forget a token (its segment is gone); a used one is already forgotten."""
        offer = self._offers.pop(token, None) if token is not None else None
        if offer is not None:
            session, fd = offer
            self._by_session.get(session.id, set()).discard(token)
            os.close(fd)

    def forget(self, session: Session) -> None:
        """The session ended: its uncollected memfds go (the memory goes with the last mapping)."""
        for token in self._by_session.pop(session.id, set()):
            offer = self._offers.pop(token, None)
            if offer is not None:
                os.close(offer[1])

    def _redeem(self, token: bytes, peer_pid: int) -> tuple[int, str]:
        """(fd, "") for a good token (deleted now), else (-1, why)."""
        if len(token) != TOKEN_BYTES:
            return -1, f"a token is {TOKEN_BYTES} bytes, got {len(token)}"
        offer = self._offers.get(token)
        if offer is None:
            return -1, "unknown or already used token"
        session, fd = offer
        if not session.running:
            return -1, "the token's session has ended"
        if session.pid > 0 and not _same_process(session.pid, peer_pid):
            # Left in place: a leaked token must not let a stranger take the owner's memory away.
            log.warning("fd socket: pid %d offered a token of session %d (pid %d)", peer_pid, session.id, session.pid)
            return -1, "the token belongs to another process's session"
        del self._offers[token]
        self._by_session[session.id].discard(token)
        return fd, ""

    # --- the socket ----------------------------------------------------------------------------
    def open(self) -> Path:
        """Bind and listen (synchronously: at daemon start, before anything is served)."""
        path = self.shm_dir / f"{PREFIX}{self._instance()}.fds.{secrets.token_hex(6)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            with unix_address(path) as addr:
                sock.bind(addr)
            os.chmod(path, 0o600)  # until then the peer-uid check refuses strangers
            sock.listen(64)
        except BaseException:
            sock.close()
            path.unlink(missing_ok=True)
            raise
        self._listener, self.path = sock, path
        return path

    async def serve(self) -> None:
        """Accept until cancelled; each connection is one bounded exchange."""
        assert self._listener is not None, "FdChannel.open() first"
        listener = trio.socket.from_stdlib_socket(self._listener)
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    conn, _ = await listener.accept()
                except OSError as exc:  # EMFILE and friends: back off, never spin
                    log.warning("fd socket: accept failed: %s", exc)
                    await trio.sleep(0.05)
                    continue
                while len(self._conns) >= self.MAX_CONNECTIONS:
                    _, oldest = self._conns.popitem(last=False)
                    oldest.cancel()
                key = self._next_conn
                self._next_conn += 1
                scope = trio.CancelScope(deadline=trio.current_time() + self.TIMEOUT_S)
                self._conns[key] = scope
                nursery.start_soon(self._serve_one, conn, key, scope)

    async def _serve_one(self, conn: trio.socket.SocketType, key: int, scope: trio.CancelScope) -> None:
        fd = -1
        try:
            with conn, scope:
                pid, uid, _ = peer_credentials(conn)  # type: ignore[arg-type]
                if uid != os.geteuid():
                    self.counters["fds_refused"] += 1
                    return  # not ours to talk to
                token = await conn.recv(TOKEN_BYTES + 1)
                fd, why = self._redeem(token, pid)
                if fd < 0:
                    self.counters["fds_refused"] += 1
                    await conn.send((REFUSED + why.encode())[:MAX_REPLY])
                    return
                await conn.sendmsg([OK], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                self.counters["fds_passed"] += 1
        except OSError:
            pass  # the peer went away; a token it used is spent
        finally:
            if fd >= 0:
                os.close(fd)  # in flight the kernel holds its own reference
            self._conns.pop(key, None)

    def close(self) -> None:
        """Stop listening, remove the socket, drop every uncollected memfd."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None
        for _, fd in self._offers.values():
            os.close(fd)
        self._offers.clear()
        self._by_session.clear()
