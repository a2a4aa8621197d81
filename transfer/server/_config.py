"""Daemon settings (one frozen dataclass; the CLI fills it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..memory import default_shm_dir
from ..protocol import Limits
from ..transport._zmq import default_endpoint

__all__ = ["DaemonConfig"]


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
    #: Whole-daemon device memory budget (NumPy backend: host RAM standing in).
    max_device_bytes: int = 16 << 30
    #: Frames queued per session before new ones are refused with QuotaExceeded.
    max_queued_frames: int = 1024
    #: Data requests whose bytes total less than this run on the event loop; more go to a thread.
    inline_bytes: int = 256 << 10
    #: Worker threads for large copies and reads (NumPy releases the GIL).
    threads: int = 2
    #: Seconds a graceful shutdown waits for in-flight requests.
    shutdown_grace_s: float = 10.0
    allow_remote_tcp: bool = False
