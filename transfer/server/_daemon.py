"""The trio daemon: sockets, signals, graceful shutdown."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import trio
import zmq

from ..transport._zmq import SocketPump, check_endpoint, ipc_path
from ._config import DaemonConfig, fd_budget
from ._connections import ConnectionGuard
from ._preflight import STARTUP_LOGGER, check_memory, check_shm_dir, startup_line
from ._server import Server

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

__all__ = ["serve", "run"]

log = logging.getLogger("transfer.daemon")


def _prepare_ipc(endpoint: str, created: list[Path]) -> Path | None:
    """Bind only in a private directory: ours, mode 0700 or stricter; clear a stale socket file.

    A directory the daemon creates is made 0700, and added to `created` (the daemon removes
    it again on exit, if it is empty then). One that already exists is
    used only if it belongs to this user and grants group and other nothing:
    in a directory others can write (a world-writable one like /tmp, sticky
    or not) another user could bind first or swap the socket for their own,
    and clients would talk to them.
    """
    path = ipc_path(endpoint)
    if path is None:
        return None
    parent = path.parent
    if not parent.exists():
        missing = [d for d in (parent, *parent.parents) if not d.exists()]
        parent.mkdir(mode=0o700, parents=True)
        os.chmod(parent, 0o700)  # mkdir's mode is filtered by the umask; never widened here
        created.extend(missing)  # (innermost first: the order to remove them in)
    st = parent.stat()
    if st.st_uid != os.geteuid():
        raise PermissionError(f"refusing to bind {endpoint}: socket directory {parent} belongs to uid {st.st_uid}, not to this user ({os.geteuid()})")
    if st.st_mode & 0o077:
        raise PermissionError(
            f"refusing to bind {endpoint}: socket directory {parent} has mode {stat.S_IMODE(st.st_mode):04o}; "
            "it must be private to this user (chmod 700, or name a directory the daemon may create)"
        )
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


def _raise_fd_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (libzmq aborts the process when an
    accept finds no free descriptor); return the limit now in force."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not Linux
        return 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the fd limit from %d to %d: %s", soft, want, exc)
    return soft


async def serve(
    config: DaemonConfig,
    *,
    task_status: trio.TaskStatus[Server] = trio.TASK_STATUS_IGNORED,
    stop: trio.Event | None = None,
    on_drain: Callable[[], object] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set, for an embedded daemon); then drain and release
    everything. `on_drain` is called when the drain begins (transferd tells systemd: STOPPING=1)."""
    shm = check_shm_dir(config.shm_dir)  # before anything is probed or bound: a typo fails at once
    memory = check_memory(config)
    server = Server(config)
    budget = fd_budget(config, _raise_fd_limit())
    server.front.max_sessions = budget.sessions
    server.fds.max_waiting, server.fds.max_offers = budget.handover, budget.offers
    server.resources.max_host_segments = budget.segments
    log.info(
        "fd limit %d: at most %d sessions%s, %d connections, %d shared-memory segments, %d uncollected memfds, "
        "%d fd-socket peers waiting, %d metrics connections", budget.nofile, budget.sessions,
        "" if config.max_sessions else " (sized from the fd limit)", budget.connections, budget.segments, budget.offers,
        budget.handover, budget.metrics,
    )
    swept = server.open()
    if swept:
        log.warning("removed %d shared-memory files left by dead daemons", len(swept))
    try:
        if config.metrics_port:
            _start_metrics(server, config, budget.metrics)
    except BaseException:
        server.close()
        raise
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.LINGER, 1000)
    # Frames between the negotiated limit and this hard cap get a FrameTooLarge reply;
    # beyond it zmq drops the connection before we would buffer the bytes.
    sock.setsockopt(zmq.MAXMSGSIZE, max(64 << 20, config.limits.max_frame_bytes * 4))
    sock.setsockopt(zmq.RCVHWM, 0)
    # Finite: a client that stops reading fills its own pipe, then its replies are parked
    # (SocketPump) up to max_reply_backlog bytes, then its session ends.
    sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
    ipc_paths: list[Path] = []
    made_dirs: list[Path] = []  # directories it created for its sockets (removed on exit when empty)
    secure: zmq.Socket[bytes] | None = None  # tcp with CURVE: its own ROUTER (ipc peers need no keys)
    auth: ThreadAuthenticator | None = None
    # A connection with no live session, silent this long, is closed (its session, if it had
    # one, was reaped after session_timeout_s of silence). Watching starts before each bind.
    guard = ConnectionGuard(budget.connections, 2 * config.session_timeout_s, lambda ident: ident in server.front.sessions)
    server.connection_counters = guard.counters
    seen: dict[int, tuple[float, bytes]] = {}
    secure_seen: dict[int, tuple[float, bytes]] = {}
    try:
        guard.watch(sock, PLAIN_PREFIX, seen)
        curve = bool(config.curve_dir)
        for ep in config.endpoints:
            check_endpoint(ep, allow_remote_tcp=config.allow_remote_tcp, curve=curve, allow_insecure_tcp=config.allow_insecure_tcp)
            if curve and ep.startswith("tcp://"):
                if secure is None:
                    secure, auth = _curve_router(ctx, config)
                    guard.watch(secure, SECURE_PREFIX, secure_seen)
                secure.bind(ep)
                continue
            p = _prepare_ipc(ep, made_dirs)
            sock.bind(ep)
            if p is not None:
                os.chmod(p, 0o600)
                ipc_paths.append(p)
        cap = config.max_reply_backlog
        pump = SocketPump(sock, max_backlog=cap, on_overflow=lambda ident: server.front.reply_overflow(PLAIN_PREFIX + ident), seen=seen)
        secure_pump = None
        if secure is not None:
            secure_pump = SocketPump(secure, max_backlog=cap, on_overflow=lambda ident: server.front.reply_overflow(SECURE_PREFIX + ident),
                                     seen=secure_seen)
        # Signal receivers need the main thread; an embedded daemon is stopped by its event instead.
        # Beneath the receiver: a signal after the first (a second SIGTERM during the drain, or
        # one during the cleanup after it) is logged, not the default death that would leave the
        # sockets and shared-memory files behind, or exit -15 once they are gone. trio's receiver
        # restores this handler when it closes and re-delivers what it still held into it.
        # Ignored once the cleanup is done (the interpreter's exit would restore the default
        # death): a daemon that stops on signals is its process's main, and exits next.
        if stop is None:
            for sig in _STOP_SIGNALS:
                signal.signal(sig, _late_signal)
        receiver = trio.open_signal_receiver(*_STOP_SIGNALS) if stop is None else contextlib.nullcontext(None)
        with receiver as signals:
            async with trio.open_nursery() as nursery:
                server.attach(nursery, _route(pump, secure_pump))
                # Session identity comes from the transport: the daemon prefixes every zmq
                # identity with the socket it came from, so no client can pick a prefix.
                nursery.start_soon(pump.run, lambda parts: server.on_message([PLAIN_PREFIX + parts[0], *parts[1:]]) if parts else server.on_message(parts))
                if secure_pump is not None:
                    nursery.start_soon(secure_pump.run, lambda parts: server.on_message([SECURE_PREFIX + parts[0], *parts[1:]], secure=True) if parts else None)
                nursery.start_soon(server.reap_silent)
                nursery.start_soon(guard.run)
                nursery.start_soon(server.fds.serve)  # clients collect their memfds here (server._fds)
                nursery.start_soon(server.channels.serve)  # remote sessions' data channels (server._channels)
                logging.getLogger(STARTUP_LOGGER).info(
                    "%s", startup_line(config, shm, server.backend.name, server.backend_reason, budget.sessions, budget.connections, memory,
                                       server.dataplane.describe())
                )
                task_status.started(server)
                if signals is None:
                    assert stop is not None
                    await stop.wait()
                else:
                    async for signum in signals:
                        log.info("signal %d: draining", signum)
                        break
                if on_drain is not None:
                    on_drain()
                await _drain(server, [pump] if secure_pump is None else [pump, secure_pump], config.shutdown_grace_s)
                nursery.cancel_scope.cancel()
    finally:
        server.metrics.stop_http()
        server.close()
        guard.close()
        sock.close(linger=500)
        if secure is not None:
            secure.close(linger=500)
        if auth is not None:
            auth.stop()
        ctx.term()
        for p in ipc_paths:
            p.unlink(missing_ok=True)
        for d in made_dirs:  # what it created for its sockets, if nothing else is there now
            try:
                d.rmdir()
            except OSError:
                break
        if stop is None:
            for sig in _STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)  # stopped: nothing is left for a signal to stop


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _late_signal(signum: int, frame: object) -> None:
    """A stop signal once the daemon is stopping already: it goes on stopping."""
    log.warning("signal %d: already shutting down (the drain and cleanup go on; SIGKILL stops the daemon at once, "
                "leaving its files for the next daemon's sweep)", signum)


PLAIN_PREFIX, SECURE_PREFIX = b"\x00", b"\x01"
#: Reply messages zmq queues per peer before sends to it fail with EAGAIN (then parked).
REPLY_HWM = 16


def _curve_router(ctx: zmq.Context[zmq.Socket[bytes]], config: DaemonConfig) -> tuple[zmq.Socket[bytes], ThreadAuthenticator]:
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
    sock.setsockopt(zmq.SNDHWM, REPLY_HWM)
    return sock, auth


def _start_metrics(server: Server, config: DaemonConfig, connections: int) -> None:
    """Serve the server's Metrics (it reads its own counters and sessions when scraped)."""
    try:
        server.metrics_port = server.metrics.start_http(config.metrics_port, config.metrics_addr, max_connections=connections,
                                                         timeout_s=config.metrics_timeout_s)
    except OSError as exc:
        raise RuntimeError(
            f"cannot serve metrics on {config.metrics_addr}:{config.metrics_port}: {exc.strerror or exc} "
            "(another transferd or exporter holds the port? choose another --metrics-port, or 0 to turn metrics off)"
        ) from None
    log.info("metrics on http://%s:%d/metrics", config.metrics_addr, server.metrics_port)


def _route(plain: SocketPump, secure: SocketPump | None) -> Callable[[bytes, bytes], None]:
    """Replies go back through the socket the identity's prefix names."""

    def send(identity: bytes, data: bytes) -> None:
        if identity[:1] == SECURE_PREFIX and secure is not None:
            secure.send_nowait([identity[1:], data])
        elif identity[:1] == PLAIN_PREFIX:
            plain.send_nowait([identity[1:], data])

    return send


#: After the grace: how long the daemon waits for work already on worker threads (it cannot be
#: interrupted), and then for the replies to leave.
_STOP_WAIT_S = 30.0
_FLUSH_WAIT_S = 2.0


async def _drain(server: Server, pumps: list[SocketPump], grace: float) -> None:
    """Stop accepting; let queued work finish for `grace` seconds, fail what is left with
    ShuttingDown, and flush every reply before the sockets close."""
    front = server.front
    sessions = front.drain()  # each session task finishes what is queued, then exits
    with trio.move_on_after(grace):
        for s in sessions:
            await s.finished.wait()
    left = [s for s in sessions if not s.finished.is_set()]
    if left:
        log.warning("shutdown grace (%.1f s) ran out: %d session(s) still had work; failing it with ShuttingDown", grace, len(left))
        front.stop(left)  # queued requests answered ShuttingDown; a running wave finishes and is answered
        with trio.move_on_after(_STOP_WAIT_S):
            for s in left:
                await s.finished.wait()
    with trio.move_on_after(_FLUSH_WAIT_S):
        for pump in pumps:
            await pump.wait_drained()
    log.info("drained: %d sessions finished (%d past the grace); exiting", len(sessions), len(left))


def run(config: DaemonConfig) -> int:
    trio.run(serve, config)
    return 0

