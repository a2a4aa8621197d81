"""The daemon's fd socket: single-use tokens for sealed memfds (segments, rings).

The daemon never names shared memory by a path (a client could truncate any
file it can open for writing, and the daemon would die of SIGBUS on its next
access: `transfer.memory._shm`). A RegisterHost or OpenRing reply carries a
random token instead; the client connects to this socket, sends the token,
and receives the memfd (SCM_RIGHTS; wire in `transfer.transport._fds`).

What a peer of this socket can make the daemon do, and its bounds:

- The socket is ``transfer.<instance>.fds.<random 64 bits>`` in the shm dir, mode 0600
  (the shm dir may be world-writable, so the name is unguessable, and a
  restarting daemon sweeps a dead instance's socket with its other files).
- A peer of another uid is refused at once (SO_PEERCRED). A token's memfd goes
  only to the process that opened its session (SO_PEERCRED pid, read through
  the peer's pid namespace) when the session named a pid; a token is deleted on
  use, with its segment, and with its session; a session may have at most
  `MAX_PER_SESSION` outstanding, and the daemon `max_offers` (its fd budget).
- Nothing here blocks the event loop: non-blocking sockets, one bounded read and
  one bounded send per connection. A client sends its token as it connects, so
  it is usually there when the connection is accepted, and is answered at once.
  A peer that has not spoken yet waits with a deadline (`TIMEOUT_S`), among at
  most `max_waiting`: one more evicts a waiting peer of the process holding the
  most of them, so one process's silent connections evict each other, never a
  client mid-handover. While the kernel's backlog is full, a client's connect
  waits (bounded) instead of failing; a client whose connection was evicted
  before its token was read asks again (`transport._fds.fetch_fd`).
"""

from __future__ import annotations

import array
import logging
import os
import secrets
import socket
from collections import Counter
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
    #: Peers that connected and have not sent their token yet, by default (`max_waiting`);
    #: one more evicts a waiting peer of the process that holds the most.
    MAX_WAITING = 16
    #: Seconds a peer may take from accept to sending its token.
    TIMEOUT_S = 2.0
    #: Connections the kernel queues before accept; a client's connect waits while it is full.
    BACKLOG = 128

    def __init__(self, shm_dir: Path, instance: Callable[[], str], max_waiting: int = MAX_WAITING, max_offers: int = 1 << 16) -> None:
        self.shm_dir = shm_dir
        self._instance = instance
        self.path: Path | None = None
        self._listener: socket.socket | None = None
        #: token -> (session, memfd)
        self._offers: dict[bytes, tuple[Session, int]] = {}
        self._by_session: dict[int, set[bytes]] = {}
        self.max_waiting = max_waiting
        #: Offers outstanding daemon-wide (each holds a descriptor: the fd budget's share).
        self.max_offers = max_offers
        #: Told a session's process as this daemon sees it (SO_PEERCRED) on its first handover,
        #: when that is not the pid its hello gave (a client in a pid namespace of its own).
        self.on_peer: Callable[[Session, int], None] = lambda session, pid: None
        #: key -> (peer pid, its deadline's scope), oldest first.
        self._waiting: dict[int, tuple[int, trio.CancelScope]] = {}
        self._next_conn = 0
        self._foreign = 0  # tokens offered by another process than their session's
        self.counters = {"fds_passed": 0, "fds_refused": 0, "fds_evicted": 0}

    # --- tokens (synchronous, on the trio thread) ----------------------------------------------
    def check_room(self, session: Session, fds: int = 1) -> None:
        """Refuse (QuotaExceeded) unless the session may be offered `fds` more handles."""
        n = len(self._by_session.get(session.id, ()))
        if n + fds > self.MAX_PER_SESSION:
            raise E.QuotaExceeded(f"session has {n} memory handles it has not collected from the fd socket (limit {self.MAX_PER_SESSION})")
        if len(self._offers) + fds > self.max_offers:
            raise E.QuotaExceeded(f"the daemon holds {len(self._offers)} memory handles its clients have not collected (its limit, "
                                  "from the fd limit); try again once they are")

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
            self._foreign += 1
            if self._foreign == 1 or self._foreign % 1000 == 0:  # (a flood must not flood the log)
                log.warning("fd socket: pid %d offered a token of session %d (pid %d); %d such so far",
                            peer_pid, session.id, session.pid, self._foreign)
            return -1, "the token belongs to another process's session"
        del self._offers[token]
        self._by_session[session.id].discard(token)
        if peer_pid != session.host_pid:
            session.host_pid = peer_pid
            self.on_peer(session, peer_pid)
        return fd, ""

    # --- the socket ----------------------------------------------------------------------------
    def open(self) -> Path:
        """Bind and listen (synchronously: at daemon start, before anything is served)."""
        path = self.shm_dir / f"{PREFIX}{self._instance()}.fds.{secrets.token_hex(8)}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            with unix_address(path) as addr:
                sock.bind(addr)  # (EADDRINUSE if the name exists: bind never follows or replaces)
            os.chmod(path, 0o600)  # until then the peer-uid check refuses strangers
            sock.listen(self.BACKLOG)
        except BaseException:
            sock.close()
            path.unlink(missing_ok=True)
            raise
        self._listener, self.path = sock, path
        return path

    async def serve(self) -> None:
        """Accept until cancelled. A peer whose token is already there (a client sends it as
        it connects) is answered at once, in this task; one that has not sent it yet waits
        in a task of its own, with a deadline, among at most `max_waiting`."""
        listener = self._listener
        assert listener is not None, "FdChannel.open() first"
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(listener)
                    continue
                except OSError as exc:  # EMFILE and friends: back off, never spin
                    log.warning("fd socket: accept failed: %s", exc)
                    await trio.sleep(0.05)
                    continue
                conn.setblocking(False)
                try:
                    pid, uid, _ = peer_credentials(conn)
                except OSError:
                    conn.close()
                    continue
                if uid != os.geteuid():
                    self.counters["fds_refused"] += 1
                    conn.close()  # not ours to talk to
                    continue
                try:
                    token = conn.recv(TOKEN_BYTES + 1)
                except BlockingIOError:
                    self._wait_for_token(nursery, conn, pid)
                    continue
                except OSError:
                    conn.close()
                    continue
                with conn:
                    self._answer(conn, token, pid)
                await trio.lowlevel.checkpoint()  # a flood of quick peers still lets the loop run

    def _wait_for_token(self, nursery: trio.Nursery, conn: socket.socket, pid: int) -> None:
        """Park a peer that has not sent its token; at the cap, first evict a waiting peer of
        the process that holds the most (its oldest): a flood evicts itself, not the client
        whose token is a moment away. A peer whose token was read is never evicted."""
        while len(self._waiting) >= self.max_waiting:
            counts = Counter(p for p, _ in self._waiting.values())
            heaviest = max(counts.values())
            key = next(k for k, (p, _) in self._waiting.items() if counts[p] == heaviest)
            self._waiting.pop(key)[1].cancel()
            self.counters["fds_evicted"] += 1
        key = self._next_conn
        self._next_conn += 1
        scope = trio.CancelScope(deadline=trio.current_time() + self.TIMEOUT_S)
        self._waiting[key] = (pid, scope)
        nursery.start_soon(self._serve_waiting, conn, pid, key, scope)

    async def _serve_waiting(self, conn: socket.socket, pid: int, key: int, scope: trio.CancelScope) -> None:
        with conn:
            token = None
            with scope:
                await trio.lowlevel.wait_readable(conn)
                self._waiting.pop(key, None)  # has spoken: no longer evictable
                try:
                    token = conn.recv(TOKEN_BYTES + 1)
                except OSError:
                    return
            self._waiting.pop(key, None)
            if token is not None:
                self._answer(conn, token, pid)

    def _answer(self, conn: socket.socket, token: bytes, pid: int) -> None:
        """One exchange's answer (non-blocking: a reply of at most MAX_REPLY bytes fits an
        empty socket's buffer). A peer that left has spent its token."""
        if not token:
            return  # connected and left
        fd, why = self._redeem(token, pid)
        try:
            if fd < 0:
                self.counters["fds_refused"] += 1
                conn.send((REFUSED + why.encode())[:MAX_REPLY])
                return
            conn.sendmsg([OK], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
            self.counters["fds_passed"] += 1
        except OSError:
            pass
        finally:
            if fd >= 0:
                os.close(fd)  # in flight the kernel holds its own reference

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
