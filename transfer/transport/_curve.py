"""ZeroMQ CURVE for the tcp control plane: key files, the daemon's allowlist, the client's handshake.

Key files are ZeroMQ's own certificate format (`zmq.auth.create_certificates`):
``NAME.key`` holds a public key, ``NAME.key_secret`` the pair. `transferd keygen
DIR` (transfer/cli/_keys.py) lays them out as::

    DIR/server.key, DIR/server.key_secret          the daemon's pair (pin server.key on clients)
    DIR/clients/NAME.key, NAME.key_secret           a client's pair (give it to that client)
    DIR/authorized_clients/NAME.key                 the daemon's allowlist (public keys only)

The daemon (``--curve-dir DIR``) serves tcp with CURVE and a ZAP handler that
admits only keys in ``authorized_clients``. A client pins the server's public
key: a wrong server key, or a client key not on the list, fails the handshake,
and `wait_handshake` turns that into `DaemonUnavailable` at once instead of a
silent hang until the connect timeout.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard, Union

import zmq
import zmq.auth

from ._zmq import monitor_socket, stop_monitor

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

from .. import errors as E

__all__ = [
    "KeySource",
    "server_keys",
    "authorized_dir",
    "public_key",
    "client_keypair",
    "apply_server",
    "apply_client",
    "start_authenticator",
    "wait_handshake",
]

#: A z85 key (40 characters, str or bytes) or a path to a key file.
KeySource = Union[str, bytes, os.PathLike[str]]


def _is_z85(v: Any) -> TypeGuard[str | bytes]:
    """40 characters of z85 (bytes, or a str that is not an existing file)."""
    if isinstance(v, bytes):
        return len(v) == 40
    return isinstance(v, str) and len(v) == 40 and not os.path.exists(v)


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise E.InvalidField(f"cannot read CURVE key file {path}: {exc}") from None


def public_key(src: KeySource) -> bytes:
    """A public key: z85 text, or a ``.key`` / ``.key_secret`` file."""
    if _is_z85(src):
        return src.encode() if isinstance(src, str) else bytes(src)
    return _load(Path(os.fsdecode(src)))[0]


def client_keypair(src: KeySource | tuple[KeySource, str | bytes] | None) -> tuple[bytes, bytes]:
    """(public, secret): a ``NAME.key_secret`` file, a (public, secret) pair, or None (ephemeral:
    only useful against a daemon that authorizes any key, which transferd does not)."""
    if src is None:
        return zmq.curve_keypair()
    if isinstance(src, tuple):
        pub_src, sec_z85 = src
        return public_key(pub_src), (sec_z85.encode() if isinstance(sec_z85, str) else bytes(sec_z85))
    pub, sec = _load(Path(os.fsdecode(src)))
    if sec is None:
        raise E.InvalidField(f"{os.fsdecode(src)} holds no secret key (use the NAME.key_secret file)")
    return pub, sec


def server_keys(curve_dir: str | Path) -> tuple[bytes, bytes]:
    path = Path(curve_dir) / "server.key_secret"
    pub, sec = _load(path)
    if sec is None:
        raise E.InvalidField(f"{path} holds no secret key")
    mode = path.stat().st_mode
    if mode & 0o077:
        raise PermissionError(f"{path} is readable by others (mode {mode & 0o777:o}): chmod 600 it")
    return pub, sec


def authorized_dir(curve_dir: str | Path) -> Path:
    return Path(curve_dir) / "authorized_clients"


def apply_server(sock: zmq.Socket[bytes], curve_dir: str | Path) -> None:
    pub, sec = server_keys(curve_dir)
    sock.curve_server = True
    sock.curve_publickey = pub
    sock.curve_secretkey = sec
    sock.zap_domain = b"transfer"


def start_authenticator(ctx: zmq.Context[zmq.Socket[bytes]], curve_dir: str | Path) -> ThreadAuthenticator:
    """A ZAP handler (a thread blocked in zmq poll: no CPU while idle) admitting the allowlist."""
    from zmq.auth.thread import ThreadAuthenticator

    allowed = authorized_dir(curve_dir)
    if not allowed.is_dir():
        raise ValueError(f"{allowed} does not exist: run `transferd keygen {curve_dir}`")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="transfer", location=str(allowed))  # = the socket's zap_domain
    return auth


def apply_client(sock: zmq.Socket[bytes], server_key: KeySource, client_keys: Any = None) -> None:
    pub, sec = client_keypair(client_keys)
    sock.curve_serverkey = public_key(server_key)
    sock.curve_publickey = pub
    sock.curve_secretkey = sec


_FAILED = {
    getattr(zmq, "EVENT_HANDSHAKE_FAILED_NO_DETAIL", 0x0800): "no detail",
    getattr(zmq, "EVENT_HANDSHAKE_FAILED_PROTOCOL", 0x2000): "protocol",
    getattr(zmq, "EVENT_HANDSHAKE_FAILED_AUTH", 0x4000): "refused by the daemon's authenticator",
}
_SUCCEEDED = getattr(zmq, "EVENT_HANDSHAKE_SUCCEEDED", 0x1000)


def monitor(sock: zmq.Socket[bytes]) -> zmq.Socket[bytes]:
    """Call before connect: a PAIR socket receiving the handshake events."""
    events = _SUCCEEDED | zmq.EVENT_DISCONNECTED
    for ev in _FAILED:
        events |= ev
    return monitor_socket(sock, events)


def wait_handshake(sock: zmq.Socket[bytes], mon: zmq.Socket[bytes], endpoint: str, timeout: float, curve: bool) -> None:
    """Until the zmq handshake with the daemon succeeded; DaemonUnavailable if it fails or times out."""
    from zmq.utils.monitor import recv_monitor_message

    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not mon.poll(int(left * 1000)):  # what pyzmq does with a float
                raise E.DaemonUnavailable(f"no daemon answered at {endpoint} within {timeout}s")
            ev = recv_monitor_message(mon)["event"]
            if ev == _SUCCEEDED:
                return
            if ev in _FAILED or ev == zmq.EVENT_DISCONNECTED:
                why = _FAILED.get(ev, "the daemon closed the connection")
                hint = (
                    "wrong server key, or this client's key is not in the daemon's authorized_clients"
                    if curve
                    else "the daemon probably requires CURVE keys (connect with server_key=..., client_keys=...)"
                )
                raise E.DaemonUnavailable(f"handshake with {endpoint} failed ({why}): {hint}")
    finally:
        stop_monitor(sock)
        mon.close(0)
