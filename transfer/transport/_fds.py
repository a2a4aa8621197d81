"""Passing memfds from the daemon to its clients over a Unix socket (SCM_RIGHTS).

The wire, one exchange per connection on a SOCK_SEQPACKET socket:

    client -> daemon   the token (TOKEN_BYTES), exactly one message
    daemon -> client   b"\\x00" with the fd attached, or b"\\x01" + a reason (utf-8), no fd

then the daemon closes the connection. A token comes in a RegisterHost or
OpenRing reply over the control socket; it is single-use. The daemon's side
is `transfer.server._fds`; this module is what both sides share and the
client's (blocking) fetch.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from pathlib import Path
from typing import Iterator

from .. import errors as E

__all__ = ["TOKEN_BYTES", "OK", "REFUSED", "MAX_REPLY", "daemon_pidfd", "fetch_fd", "peer_credentials", "unix_address"]

TOKEN_BYTES = 16
OK, REFUSED = b"\x00", b"\x01"
#: The longest reply the daemon sends (a refusal's reason is cut to fit).
MAX_REPLY = 256
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path holds 108 bytes, NUL included


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of a connected Unix socket's peer, as of its connect()."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def daemon_pidfd(path: str | os.PathLike[str] | None, pid: int, timeout: float = 2.0) -> int:
    """A pidfd of the daemon whose fd socket is `path` and whose hello said `pid`, if that pid
    names it in this process's pid namespace (SO_PEERCRED of a bare connection to its socket
    says who listens there, as we see it: 0 when it is in no namespace of ours). OSError
    otherwise: a producer in a pid namespace of its own must not watch a stranger that has
    the daemon's number."""
    if path is None:
        raise OSError("no fd socket to ask")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))
        with unix_address(path) as addr:
            sock.connect(addr)
        seen, _, _ = peer_credentials(sock)
    finally:
        sock.close()  # (no token: the daemon lets the connection go)
    if seen != pid:
        raise OSError(f"the daemon is pid {seen or 'invisible'} here, not {pid}")
    return os.pidfd_open(pid)


@contextlib.contextmanager
def unix_address(path: str | os.PathLike[str]) -> Iterator[str]:
    """An address for `path` that fits sockaddr_un: the path itself, or, when it is too long,
    the same file reached through an open descriptor of its directory (/proc/self/fd/N/NAME)."""
    p = Path(path)
    if len(os.fsencode(p)) <= _SUN_PATH_MAX:
        yield str(p)
        return
    dfd = os.open(p.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        short = f"/proc/self/fd/{dfd}/{p.name}"
        if len(os.fsencode(short)) > _SUN_PATH_MAX:
            raise OSError(f"socket name {p.name!r} is too long")
        yield short
    finally:
        os.close(dfd)


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


class _Unanswered(Exception):
    """The daemon closed the connection without reading the token (a busy socket's eviction,
    or its deadline): the token is unspent, so asking again is safe."""


def fetch_fd(path: str | os.PathLike[str], token: bytes, timeout: float = 5.0) -> int:
    """Redeem `token` at the daemon's fd socket; return the fd (the caller's to close).

    A busy socket is waited for, within `timeout`: the connect blocks in the kernel
    (SO_SNDTIMEO) while the daemon's listen backlog is full, and a connection the daemon
    closed before reading the token (it evicts waiting peers when flooded) is made again."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise E.ConnectionLost(f"the daemon's fd socket {path} did not answer within {timeout}s")
        try:
            msg, fds, flags = _exchange(path, token, left)
        except _Unanswered:
            continue
        break
    if msg[:1] == OK and len(fds) == 1 and not flags & socket.MSG_CTRUNC:
        return fds[0]
    for fd in fds:
        os.close(fd)
    reason = msg[1:].decode("utf-8", "replace") if msg[:1] == REFUSED else f"unexpected reply {msg[:16]!r}"
    raise E.ProtocolError(f"the daemon refused the memory handle: {reason}")


def _exchange(path: str | os.PathLike[str], token: bytes, timeout: float) -> tuple[bytes, list[int], int]:
    """One connection: the token out, the reply (and any fds) back."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        # Blocking, with kernel timeouts: connect then waits for room in a full backlog
        # (a non-blocking connect fails at once with EAGAIN), and recv for the reply.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
        try:
            with unix_address(path) as addr:
                sock.connect(addr)
            _, uid, _ = peer_credentials(sock)
            if uid != os.geteuid():
                raise E.ProtocolError(f"the fd socket {path} belongs to uid {uid}, not to us")
            sock.send(token)
            msg, fds, flags, _ = socket.recv_fds(sock, MAX_REPLY, 1)
        except BlockingIOError:  # (EAGAIN: a kernel timeout ran out)
            raise E.ConnectionLost(f"the daemon's fd socket {path} did not answer within {timeout:.1f}s") from None
        except (ConnectionResetError, BrokenPipeError):
            raise _Unanswered() from None
        except OSError as exc:
            raise E.ConnectionLost(f"cannot reach the daemon's fd socket {path}: {exc}") from None
    finally:
        sock.close()
    if not msg and not fds:
        raise _Unanswered()
    return msg, fds, flags
