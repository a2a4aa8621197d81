"""Daemon settings (one frozen dataclass; `transfer._settings` fills it from flags, env and file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..memory import default_shm_dir
from ..protocol import Limits
from ..transport._zmq import default_endpoint, tcp_host

__all__ = ["DaemonConfig", "FdBudget", "fd_budget", "FDS_PER_SESSION", "FD_RESERVE"]

#: File descriptors one session can make the daemon hold: its connection, its pidfd
#: watcher, its ring's mapping (Python's mmap keeps a descriptor of the memfd) and the write
#: end of its completion pipe (clients that poll one); a remote session (no pidfd, no pipe):
#: its connection, its ring's two mappings and its data channel's socket. Uncollected
#: memfds are bounded apart (`FdChannel`).
FDS_PER_SESSION = 4
#: Descriptors kept for the daemon itself (zmq's threads and mailboxes, trio, the lock,
#: logs, the listeners, the CPU devices' processes).
FD_RESERVE = 256
#: fd-socket peers that may wait for their token at once (`server._fds.FdChannel`).
HANDOVER_WAITING = 16
#: Data-channel connections that may wait for their hello at once (`server._channels`).
CHANNEL_WAITING = 16
#: The automatic session limit never exceeds this.
MAX_AUTO_SESSIONS = 1024


@dataclass(frozen=True)
class DaemonConfig:
    endpoints: tuple[str, ...] = field(default_factory=lambda: (default_endpoint(),))
    backend: str = "numpy"
    devices: int = 1
    shm_dir: Path = field(default_factory=default_shm_dir)
    limits: Limits = Limits()
    #: Clients ping this often when idle; a session silent for `session_timeout` is reclaimed.
    heartbeat_s: float = 1.0
    session_timeout_s: float = 10.0
    #: Per-session quotas (0 = unlimited).
    max_segments_per_session: int = 4096
    max_host_bytes_per_session: int = 0
    max_device_bytes_per_session: int = 0
    #: Whole-daemon shared-memory budget (segments are memfds: RAM + swap, not a tmpfs); 0 = what the machine has.
    max_host_bytes: int = 0
    #: Host bytes a GPU backend may page-lock for DMA (pinned memory cannot be paged out);
    #: 0 = half the machine's memory. Segments past it are copied through the driver's staging.
    max_pinned_bytes: int = 0
    #: Bytes of copies a session's ring worker keeps queued on a GPU ahead of what has run: it
    #: waits for the older half before queueing more (0: no bound).
    device_queue_bytes: int = 64 << 20
    #: Whole-daemon device memory budget (NumPy backend: host RAM standing in).
    max_device_bytes: int = 16 << 30
    #: Data work of at most this many bytes (a checksum's count half) runs on the event loop; more goes to a thread.
    inline_bytes: int = 512 << 10
    #: Worker threads for large copies and reads (NumPy releases the GIL).
    threads: int = 2
    #: Placement of work whose operands are all host memory: size, least-loaded, round-robin.
    placement: str = "size"
    #: `size` placement: inputs below this many bytes go to a CPU device.
    size_threshold: int = 1 << 20
    #: Requests a session may have queued or running (credits announced in hello).
    max_inflight: int = 1 << 16
    #: Sessions the daemon serves at once; a hello beyond gets QuotaExceeded. 0 = sized from
    #: the file-descriptor limit (`session_limit`).
    max_sessions: int = 0
    #: Segment ids in each session's deferred-allocation arena, per device.
    arena_ids: int = 256
    #: Requests one scheduler pass takes from a session.
    max_pass: int = 16384
    #: Reply bytes parked for a client that is not reading them (beyond zmq's own
    #: REPLY_HWM messages per peer); past this the session is ended.
    max_reply_backlog: int = 32 << 20
    #: Seconds a graceful shutdown waits for in-flight requests.
    shutdown_grace_s: float = 10.0
    allow_remote_tcp: bool = False
    #: tcp endpoints need CURVE keys (`curve_dir`, made by `transferd keygen`) unless this is set.
    allow_insecure_tcp: bool = False
    #: Directory from `transferd keygen`: server.key_secret, and authorized_clients/*.key.
    curve_dir: str = ""
    #: Remote (NIXL) segments: allowed when NIXL is importable; the agent starts on first use.
    rdma: bool = True
    #: Seconds one NIXL post may take before its requests fail with TransferTimeout.
    remote_timeout_s: float = 30.0
    #: Same-host clients may open a shared-memory request ring (docs/ring.md).
    rings: bool = True
    #: Largest ring (descriptors) a session may ask for.
    max_ring_capacity: int = 1 << 16
    #: The TCP port remote sessions' data channels connect to (their rings, carried over
    #: TCP), on the host of the daemon's tcp endpoint; 0: any free port (announced per session).
    channel_port: int = 0
    #: After the last ring request, the daemon busy-polls the rings this long before sleeping.
    ring_spin_s: float = 200e-6
    #: Each ring gets a native worker thread that executes its copies, fills, checksums and
    #: fences without the event loop (native/dataplane.h). On by default; off
    #: (`--no-ring-workers`), the event loop serves rings itself.
    ring_workers: bool = True
    #: The ring workers queue copies and fills that touch GPU memory themselves, through the
    #: CUDA driver (native/device.c). Off (`--no-device-workers`), or without a driver, the
    #: Python pass serves every device request.
    device_workers: bool = True
    #: Threads that share large copies (8 MiB or more) with the ring workers, chunk by chunk,
    #: when idle (native/dataplane.h, "copy helpers"); -1: the cores left when every ring's
    #: worker and client have one (at most 8; none on 2 cores with a session).
    copy_helpers: int = -1
    #: How long a ring's worker spins for the next descriptor before it sleeps on the futex.
    worker_spin_s: float = 50e-6
    #: The same while every worker and its client can have a core (2 x workers <= cores):
    #: polling then costs no one a core, and saves each submission a futex wake.
    worker_spin_spare_s: float = 500e-6
    #: Prometheus metrics over HTTP (`transfer.server._metrics`); 0 = off.
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    #: Metrics HTTP connections at once; one more is answered 503 and closed.
    metrics_connections: int = 16
    #: Seconds a metrics HTTP connection may take before it is closed (a scrape, or a silent peer).
    metrics_timeout_s: float = 5.0
    #: Client names with per-session series of their own (the rest share one); 0 = no per-session series.
    metrics_sessions: int = 16


@dataclass(frozen=True)
class FdBudget:
    """How the daemon's file descriptors are shared out (`fd_budget`). Each listener and each
    kind of thing a client can make the daemon hold has a share of its own, so a flood of
    one (idle connections, silent fd-socket peers, uncollected memfds, segments) is refused
    at its own cap and never takes another's share, or the daemon's own: libzmq aborts the
    whole process when an accept finds no descriptor left."""

    nofile: int
    #: Sessions served at once (each holds FDS_PER_SESSION).
    sessions: int
    #: zmq connections, with or without a session (the rest are closed as they are accepted).
    connections: int
    #: fd-socket peers that connected and have not sent their token yet.
    handover: int
    #: Descriptors offered for clients to collect (uncollected tokens), daemon-wide.
    offers: int
    #: Host segments mapped at once (a mapping holds a descriptor), daemon-wide.
    segments: int
    #: Metrics HTTP connections (0: no metrics endpoint).
    metrics: int


def fd_budget(config: DaemonConfig, nofile: int) -> FdBudget:
    """Share `nofile` out: a reserve for the daemon itself, the metrics, fd-socket and
    data-channel listeners' caps, then 3/8 of the rest for sessions (`max_sessions` if set, at most
    MAX_AUTO_SESSIONS), 3/8 for connections beyond the sessions' own, 1/8 for uncollected
    memfds and the rest for segment mappings."""
    metrics = config.metrics_connections if config.metrics_port else 0
    channels = CHANNEL_WAITING if config.rings and tcp_host(config.endpoints) is not None else 0
    free = max(16, nofile - min(FD_RESERVE, nofile // 4) - metrics - HANDOVER_WAITING - channels)
    sessions = config.max_sessions or max(1, min(MAX_AUTO_SESSIONS, free * 3 // 8 // FDS_PER_SESSION))
    idle = free * 3 // 8
    offers = max(1, free // 8)
    segments = max(1, free - sessions * FDS_PER_SESSION - idle - offers)
    return FdBudget(nofile, sessions, sessions + idle, HANDOVER_WAITING, offers, segments, metrics)
