"""sd_notify without libsystemd: one datagram to ``$NOTIFY_SOCKET``.

systemd starts a ``Type=notify`` service with ``NOTIFY_SOCKET`` naming a Unix
datagram socket (a path, or ``@name`` in the abstract namespace); the service
sends newline-separated ``KEY=value`` assignments there: ``READY=1`` once it
serves, ``STATUS=...`` for ``systemctl status``, ``STOPPING=1`` when it begins
to shut down. Outside systemd the variable is unset and `notify` does nothing.
"""

from __future__ import annotations

import os
import socket

__all__ = ["notify"]


def notify(**fields: object) -> bool:
    """Send ``KEY=value`` lines (``notify(READY=1, STATUS="serving")``); True if sent.

    Never raises: a supervisor that went away must not take the daemon with it.
    """
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr or addr[0] not in "/@":
        return False
    target = "\0" + addr[1:] if addr[0] == "@" else addr
    payload = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.sendto(payload, target)
    except OSError:
        return False
    return True
