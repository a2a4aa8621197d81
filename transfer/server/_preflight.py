"""Startup checks and the one startup line: what an operator needs before the first client.

`check_shm_dir` refuses a shm dir that is missing or unusable (a typo in
``--shm-dir`` must not create a stray directory) and says what filesystem it
is on; `check_memory` compares the configured shared-memory quotas with what
the kernel can still give memfds; `startup_line` is the single line the
daemon logs once it serves (version, endpoint, shm dir, backend and why, limits).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from .._units import fmt_bytes
from ..memory._shm import memory_available
from ._config import DaemonConfig

__all__ = ["ShmDir", "check_shm_dir", "check_memory", "startup_line", "fmt_bytes", "STARTUP_LOGGER"]

#: The startup line's logger: `transfer._settings.setup_logging` lets it through at the default level.
STARTUP_LOGGER = "transfer.daemon.startup"

log = logging.getLogger("transfer.daemon")

# statfs f_type values (linux/magic.h) of memory-backed filesystems.
_MEMORY_FS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
#: The shm dir must have at least this much room: the lock and the fd socket.
MIN_SHM_DIR_FREE = 1 << 20


@dataclass(frozen=True)
class ShmDir:
    """The shm dir as found at startup."""

    path: Path
    fs: str  # "tmpfs", "ramfs", or the mount's type from /proc/self/mounts
    size: int  # bytes of the filesystem
    free: int  # bytes an unprivileged writer may still use

    @property
    def in_memory(self) -> bool:
        return self.fs in _MEMORY_FS.values()


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (the longest matching mount point)."""
    best, fs = "", "unknown"
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fs = mnt, parts[2]
    except OSError:
        pass
    return fs


def _check_shared(path: Path) -> None:
    """Refuse a shm dir where another user could remove or replace the daemon's files.

    The daemon's names there are unguessable and created exclusively, so a directory
    others may write is safe only if they cannot unlink or rename what it made: it must
    be ours, or root's with the sticky bit (as /dev/shm and /tmp are), and if others may
    write it, sticky. Anything else would let another user swap the fd socket or the lock
    under a running daemon; it fails now, not later.
    """
    st = path.stat()  # (follows a symlink: what matters is the directory the files land in)
    mode = stat.S_IMODE(st.st_mode)
    sticky = bool(st.st_mode & stat.S_ISVTX)
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise RuntimeError(
            f"shm dir {path} belongs to uid {st.st_uid}: its owner could remove or replace the daemon's files; "
            f"use a directory of this user ({me}) or a root-owned sticky one such as /dev/shm"
        )
    if st.st_uid != me and not sticky:
        raise RuntimeError(f"shm dir {path} belongs to root without the sticky bit: pass a directory of this user ({me}) with --shm-dir")
    if mode & 0o022 and not sticky:
        raise RuntimeError(
            f"shm dir {path} has mode {mode:04o}: others may write it without the sticky bit, so they could remove or "
            f"replace the daemon's files; chmod +t {path} (or go-w), or choose another --shm-dir"
        )


def check_shm_dir(path: Path) -> ShmDir:
    """Refuse a shm dir that does not exist, is not a writable directory, or is full.

    The daemon never creates it: ``--shm-dir /dev/shm/trnasfer`` (a typo) must fail
    loudly, not leave the lock and sockets where no client looks. A directory that is
    not tmpfs works (it holds only a lock and a socket) but is logged
    as a warning: on a disk the lock outlives a reboot, on a network filesystem
    sockets may not work at all.
    """
    if not path.exists():
        raise RuntimeError(
            f"shm dir {path} does not exist: create it (mkdir -m 700 {path}) or pass an existing "
            "tmpfs directory with --shm-dir (default /dev/shm)"
        )
    if not path.is_dir():
        raise RuntimeError(f"shm dir {path} is not a directory (--shm-dir names a directory, default /dev/shm)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise RuntimeError(f"shm dir {path} is not writable by uid {os.geteuid()}: fix its permissions or choose another --shm-dir")
    _check_shared(path)
    st = os.statvfs(path)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    fs = _fs_type(path)
    if free < MIN_SHM_DIR_FREE:
        raise RuntimeError(
            f"shm dir {path} ({fs}, {fmt_bytes(size)}) has only {fmt_bytes(free)} free; the daemon needs at least "
            f"{fmt_bytes(MIN_SHM_DIR_FREE)} there for its lock and fd socket: free some space "
            "(stale files of other programs?) or choose another --shm-dir"
        )
    found = ShmDir(path, fs, size, free)
    if not found.in_memory:
        log.warning(
            "shm dir %s is on %s, not tmpfs: it works for the lock and fd socket it holds, but "
            "use a tmpfs directory such as /dev/shm (a disk keeps stale files across reboots; network "
            "filesystems may not support sockets)", path, fs,
        )
    return found


def check_memory(config: DaemonConfig) -> str:
    """Compare the shared-memory quotas with what the kernel can still give; return a summary.

    Segments are memfds: RAM and swap charged to the daemon's memory cgroup, not space in
    the shm dir (Docker's 64 MiB /dev/shm does not limit them; its --memory does). A quota
    the machine cannot honour is logged as a warning that says what to change; it does
    not stop the daemon (memory comes and goes, and the quota is only a ceiling).
    """
    room = memory_available()
    if room is None:
        return "shared memory available: unknown"
    avail, source = room
    quotas = [(config.max_host_bytes, "--max-host-bytes"), (config.max_host_bytes_per_session, "--max-host-bytes-per-session")]
    for quota, flag in quotas:
        if quota and quota > avail:
            log.warning(
                "%s is %s but only %s of shared memory is available (%s): registrations past that fail with "
                "OutOfSharedMemory. Lower %s, or give the daemon more memory (a container's --memory limit, "
                "a systemd MemoryMax=, or free RAM/swap on the host).",
                flag, fmt_bytes(quota), fmt_bytes(avail), source, flag,
            )
            break
    return f"shared memory available {fmt_bytes(avail)} ({source})"




def startup_line(config: DaemonConfig, shm: ShmDir, backend: str, backend_reason: str, sessions: int, connections: int, memory: str,
                 data_plane: str = "") -> str:
    """The one line an operator reads to know what is running and with which limits."""
    from .._version import __version__
    from ..protocol import VERSION

    def quota(n: int) -> str:
        return fmt_bytes(n) if n else "unlimited"

    return (
        f"transferd {__version__} (protocol {VERSION}, pid {os.getpid()}) serving {', '.join(config.endpoints)}; "
        f"shm dir {shm.path} ({shm.fs}, {fmt_bytes(shm.size)}, {fmt_bytes(shm.free)} free); "
        f"backend {backend} ({backend_reason}); "
        f"{'data plane: ' + data_plane + '; ' if data_plane else ''}"
        f"limits: {sessions} sessions, {connections} connections, host memory {quota(config.max_host_bytes)} "
        f"({quota(config.max_host_bytes_per_session)} per session), device memory {quota(config.max_device_bytes)} "
        f"({quota(config.max_device_bytes_per_session)} per session), {config.max_segments_per_session or 'unlimited'} "
        f"segments per session, {config.max_inflight} requests in flight per session; {memory}"
    )
