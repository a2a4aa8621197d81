"""The trio daemon: sockets, signals, graceful shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Callable

import trio
import zmq

from ..transport._zmq import SocketPump, check_endpoint, ipc_path
from ._config import DaemonConfig
from ._server import Server

__all__ = ["serve", "run"]

log = logging.getLogger("transfer.daemon")


def _prepare_ipc(endpoint: str) -> Path | None:
    """Make the socket's directory private (0700) and clear a stale socket file."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=0o700, parents=True)
    st = parent.stat()
    if st.st_uid != os.geteuid():
        raise PermissionError(f"socket directory {parent} belongs to another user")
    if path.exists():
        # Refuse to steal a live daemon's endpoint; a dead one's socket file is stale.
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise RuntimeError(f"a daemon is already listening on {endpoint}")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
        finally:
            probe.close()
    return path


async def serve(
    config: DaemonConfig,
    *,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
    stop: trio.Event | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set, for an embedded daemon); then drain and release everything."""
    server = Server(config)
    swept = server.open()
    if swept:
        log.warning("removed %d shared-memory files left by dead daemons", len(swept))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 1000)
    # Frames between the negotiated limit and this hard cap get a FrameTooLarge reply;
    # beyond it zmq drops the connection before we would buffer the bytes.
    sock.setsockopt(zmq.MAXMSGSIZE, max(64 << 20, config.limits.max_frame_bytes * 4))
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    ipc_paths: list[Path] = []
    secure: zmq.Socket | None = None  # tcp with CURVE: its own ROUTER (ipc peers need no keys)
    auth = None
    try:
        curve = bool(config.curve_dir)
        for ep in config.endpoints:
            check_endpoint(ep, allow_remote_tcp=config.allow_remote_tcp, curve=curve, allow_insecure_tcp=config.allow_insecure_tcp)
            if curve and ep.startswith("tcp://"):
                if secure is None:
                    secure, auth = _curve_router(ctx, config)
                secure.bind(ep)
                continue
            p = _prepare_ipc(ep)
            sock.bind(ep)
            if p is not None:
                os.chmod(p, 0o600)
                ipc_paths.append(p)
        pump = SocketPump(sock)
        secure_pump = SocketPump(secure) if secure is not None else None
        # Signal receivers need the main thread; an embedded daemon is stopped by its event instead.
        receiver = trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) if stop is None else contextlib.nullcontext(None)
        with receiver as signals:
            async with trio.open_nursery() as nursery:
                server.attach(nursery, _route(pump, secure_pump))
                # Session identity comes from the transport: the daemon prefixes every zmq
                # identity with the socket it came from, so no client can pick a prefix.
                nursery.start_soon(pump.run, lambda parts: server.on_message([PLAIN_PREFIX + parts[0], *parts[1:]]) if parts else server.on_message(parts))
                if secure_pump is not None:
                    nursery.start_soon(secure_pump.run, lambda parts: server.on_message([SECURE_PREFIX + parts[0], *parts[1:]], secure=True) if parts else None)
                nursery.start_soon(server.reap_silent)
                nursery.start_soon(server.fds.serve)  # clients collect their memfds here (server._fds)
                log.info("transferd %d serving %s (backend %s)", os.getpid(), ", ".join(config.endpoints), server.backend.name)
                task_status.started(server)
                if signals is None:
                    assert stop is not None
                    await stop.wait()
                else:
                    async for signum in signals:
                        log.info("signal %d: draining", signum)
                        break
                await _drain(server, pump, config.shutdown_grace_s)
                if secure_pump is not None:
                    with trio.move_on_after(1.0):
                        await secure_pump.wait_drained()
                nursery.cancel_scope.cancel()
    finally:
        server.close()
        sock.close(linger=500)
        if secure is not None:
            secure.close(linger=500)
        if auth is not None:
            auth.stop()
        ctx.term()
        for p in ipc_paths:
            p.unlink(missing_ok=True)


PLAIN_PREFIX, SECURE_PREFIX = b"\x00", b"\x01"


def _curve_router(ctx: zmq.Context, config: DaemonConfig) -> tuple[zmq.Socket, object]:
    """A ROUTER for tcp with CURVE: the daemon's key pair and a ZAP allowlist (transport._curve)."""
    from ..transport import _curve

    auth = _curve.start_authenticator(ctx, config.curve_dir)
    sock = ctx.socket(zmq.ROUTER)
    try:
        _curve.apply_server(sock, config.curve_dir)
    except BaseException:
        sock.close(0)
        auth.stop()
        raise
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, max(64 << 20, config.limits.max_frame_bytes * 4))
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    return sock, auth


def _route(plain: SocketPump, secure: SocketPump | None) -> Callable[[bytes, bytes], None]:
    """Replies go back through the socket the identity's prefix names."""

    def send(identity: bytes, data: bytes) -> None:
        if identity[:1] == SECURE_PREFIX and secure is not None:
            secure.send_nowait([identity[1:], data])
        elif identity[:1] == PLAIN_PREFIX:
            plain.send_nowait([identity[1:], data])

    return send


async def _drain(server: Server, pump: SocketPump, grace: float) -> None:
    """Stop accepting; let queued frames finish and their replies leave."""
    sessions = server.front.drain()  # each session task finishes what is queued, then exits
    with trio.move_on_after(grace):
        for s in sessions:
            await s.finished.wait()
        await pump.wait_drained()


def run(config: DaemonConfig) -> int:
    trio.run(serve, config)
    return 0

