"""The remote producer for the NIXL loopback tests: a separate process (spawn)
that registers buffers and answers commands from the test over a Pipe."""

from __future__ import annotations

import os
import zlib
from multiprocessing.connection import Connection

import numpy as np


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """The bytes a producer buffer starts with (the test regenerates them)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def producer_main(conn: Connection, name: str, declared: int, secret: int, seed: int, env: dict[str, str]) -> None:
    """Register a *declared* buffer (announced with its descriptor bytes) and a
    *secret* one (registered with NIXL, never announced); then serve commands."""
    os.environ.update(env)
    from transfer.transport._nixl import NixlEndpoint

    ep = NixlEndpoint(name)
    buf = pattern(declared, seed)
    hidden = pattern(secret, seed + 1)
    reg = ep.register(buf)
    hreg = ep.register(hidden)
    conn.send(
        {
            "pid": os.getpid(),
            "metadata": ep.metadata,  # after registering: carries both rkeys
            "descs": reg.descs_bytes,
            "secret_addr": hreg.addr,
        }
    )
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        if cmd == "crc":
            off, n = args
            conn.send(zlib.crc32(buf[off : off + n]))
        elif cmd == "notifs":
            conn.send(ep.get_notifs())
        elif cmd == "add_peer":
            conn.send(ep.add_peer(args[0]))
        elif cmd == "quit":
            break
    ep.close()
    conn.send("bye")
