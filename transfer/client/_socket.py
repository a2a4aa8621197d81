"""Connecting a client's control socket: a DEALER to the daemon's endpoint, CURVE on tcp://
when keyed (the handshake waited for, so a refused key fails at connect), and on ipc:// a
probe first, so that a missing, stale or forbidden socket file is a clear error at once
instead of a connect timeout. And a remote session's data channel (`connect_channel`)."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from typing import Any

import zmq

from .. import errors as E
from ..ring._channel import ACK, hello
from ..transport import _curve
from ..transport._zmq import endpoint_error, ipc_path, tcp_host

__all__ = ["open_socket", "connect_channel"]


def open_socket(endpoint: str, server_key: Any, client_keys: Any, connect_timeout: float) -> zmq.Socket[bytes]:
    """A connected DEALER socket (CURVE on tcp:// when keyed); a refused handshake fails now.

    On ipc:// a socket file nobody listens on (a daemon killed with -9 leaves one) is
    refused at once by a plain connect, instead of waiting out `connect_timeout` on zmq.
    """
    why = endpoint_error(endpoint)
    if why is not None:
        raise ValueError(f"bad endpoint: {why}")
    path = ipc_path(endpoint)
    if path is not None:
        _probe_ipc(endpoint, path)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    mon = None
    try:
        if endpoint.startswith("tcp://"):
            if server_key is not None:
                _curve.apply_client(sock, server_key, client_keys)
            mon = _curve.monitor(sock)
        sock.connect(endpoint)
        if mon is not None:
            _curve.wait_handshake(sock, mon, endpoint, connect_timeout, server_key is not None)
    except BaseException:
        sock.close(0)
        raise
    return sock


def _not_ours(endpoint: str, path: Path) -> E.DaemonUnavailable:
    """The error for a socket this process may not reach: whose the directory (or the socket)
    is that stops it, and what to do."""
    me = os.geteuid()
    blocker = path
    for d in reversed(path.parents):  # the first directory on the way that we may not enter
        if not os.access(d, os.X_OK):
            blocker = d
            break
    try:
        st = blocker.stat()
        whose = f"belongs to uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):04o})"
    except OSError:
        whose = "is not ours"
    return E.DaemonUnavailable(
        f"cannot reach the daemon at {endpoint}: {blocker} {whose}, and this process (uid {me}) may not "
        f"{'enter it' if blocker != path else 'connect to it'}: run as the daemon's user, or start a daemon of your own"
    )


def _probe_ipc(endpoint: str, path: Path) -> None:
    """Raise DaemonUnavailable now when no daemon can be listening at `path`, or when one may
    be but this process is not allowed to reach it."""
    try:
        exists = path.exists()
    except PermissionError:
        raise _not_ours(endpoint, path) from None
    if not exists:
        raise E.DaemonUnavailable(f"no daemon at {endpoint}: {path} does not exist (is transferd running?)")
    try:
        is_socket = stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        is_socket = True  # let the connect below say what is wrong
    if not is_socket:
        raise E.DaemonUnavailable(f"no daemon at {endpoint}: {path} is not a socket (is the endpoint's path right?)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        raise E.DaemonUnavailable(
            f"no daemon at {endpoint}: {path} is a stale socket (its daemon exited without removing it); "
            "start transferd, which replaces it"
        ) from None
    except FileNotFoundError:
        raise E.DaemonUnavailable(f"no daemon at {endpoint}: {path} does not exist (is transferd running?)") from None
    except PermissionError:
        raise _not_ours(endpoint, path) from None
    except OSError:
        pass  # too long a path: let zmq try and report
    finally:
        probe.close()


#: Seconds a data channel may take to connect and be accepted.
CHANNEL_TIMEOUT_S = 5.0


def connect_channel(endpoint: str, port: int, session: int, key: bytes, timeout: float = CHANNEL_TIMEOUT_S) -> socket.socket:
    """A session's data channel: a TCP connection to `port` on the tcp endpoint's host,
    past its hello (the session and the key the daemon gave on the control socket)."""
    host = tcp_host((endpoint,)) or "localhost"
    where = f"{host}:{port}"
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as exc:
        raise E.RingUnavailable(f"cannot connect this session's data channel to {where}: {exc}") from None
    try:
        sock.sendall(hello(session, key))
        got = b""
        while len(got) < len(ACK):
            chunk = sock.recv(len(ACK) - len(got))
            if not chunk:
                break
            got += chunk
        if got != ACK:
            raise E.RingUnavailable(f"the daemon at {where} refused this session's data channel")
    except OSError as exc:
        sock.close()
        raise E.RingUnavailable(f"this session's data channel to {where} failed: {exc}") from None
    except BaseException:
        sock.close()
        raise
    return sock
