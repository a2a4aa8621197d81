"""Shared-memory segments: sealed memfds, mapped by the daemon and handed to clients by fd.

Not `multiprocessing.shared_memory`: on Python 3.11 its resource tracker
unlinks segments when an *attaching* process exits (DESIGN.md pitfalls).

Not files in /dev/shm either: whoever can open a file for writing can also
truncate it, and a daemon that touches a mapping whose file shrank under it
dies of SIGBUS, taking every other tenant with it. So:

1. The daemon makes every segment (and every request ring) a memfd
   (``memfd_create``, ``MFD_ALLOW_SEALING``), sizes it, reserves its pages
   (``posix_fallocate``: a machine short of memory fails here, with
   `OutOfSharedMemory`, instead of with SIGBUS or the OOM killer on first
   touch), and seals it with ``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``:
   from then on nobody, whatever fd or ``/proc`` path they reach it by, can
   change its size. Then it maps it.
2. The client receives the fd over the daemon's Unix socket
   (`transfer.server._fds`, one single-use token per fd), checks that it is
   sealed and of the promised size (`check_sealed`: so a hostile daemon
   cannot SIGBUS the client either), maps it and closes the fd.
3. There is no name anywhere: the memory lives exactly as long as the last
   fd or mapping of it. kill -9 either side and the kernel frees it with the
   other; kill both and nothing remains.

The shm dir still holds what has a name: the daemon's lock and its fd socket,
both under unguessable names made exclusively (`O_EXCL`, `bind`); doorbells
are pipes, handed over the fd socket like the memfds. Each daemon holds an flock on
``transfer.<instance>.lock``; a starting daemon removes the files of every
instance whose lock it can take (`sweep_stale`).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import stat
from pathlib import Path

import numpy as np

from ..errors import InvalidField, OutOfSharedMemory, ResourceError

__all__ = [
    "ShmFile", "DaemonLock", "sweep_stale", "PREFIX", "default_shm_dir",
    "new_memfd", "reserve", "seal", "check_sealed", "memory_available", "SEALS",
]

PREFIX = "transfer."

# fcntl has these on Linux since Python 3.8; the values are the kernel's.
_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
_F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 1)
_F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)
_F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 4)
#: What every mapping the daemon hands out carries: its size is fixed for good.
SEALS = _F_SEAL_SHRINK | _F_SEAL_GROW | _F_SEAL_SEAL
_SIZE_SEALS = _F_SEAL_SHRINK | _F_SEAL_GROW


def default_shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields:
                out[key] = int(fields[0]) * 1024
    return out


_CGROUP: list[Path | None] = []  # this process's cgroup v2 directory, looked up once


def _cgroup_dir() -> Path | None:
    if not _CGROUP:
        try:
            with open("/proc/self/cgroup") as f:
                rel = next((ln.split("::", 1)[1].strip() for ln in f if ln.startswith("0::")), None)
        except OSError:
            rel = None
        _CGROUP.append(None if rel is None else Path("/sys/fs/cgroup") / rel.lstrip("/"))
    return _CGROUP[0]


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup v2 memory.max (None: no limit, or not v2)."""
    base = _cgroup_dir()
    if base is None:
        return None
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def memory_available() -> tuple[int, str] | None:
    """What the kernel can still give shared memory, and where that figure comes from.

    memfd pages are shmem: charged to the creating process's memory cgroup and
    swappable, not bounded by any tmpfs size. None if nothing can be read.
    """
    try:
        info = _meminfo()
        room, why = info["MemAvailable"] + info.get("SwapFree", 0), "MemAvailable + SwapFree"
    except (OSError, KeyError, ValueError):
        room, why = None, ""
    cg = _cgroup_room()
    if cg is not None and (room is None or cg < room):
        room, why = cg, "the memory cgroup's memory.max - memory.current"
    return None if room is None else (room, why)


def _short_of_memory(nbytes: int, what: str) -> OutOfSharedMemory:
    room = memory_available()
    have = f"{room[0]} bytes free ({room[1]})" if room else "the kernel refused the pages"
    return OutOfSharedMemory(
        f"cannot reserve {nbytes} bytes of shared memory for {what}: {have}; free memory, raise the "
        f"daemon's memory limit (container/cgroup), or bound it with --max-host-bytes"
    )


def new_memfd(name: str) -> int:
    """An empty memfd that may be sealed (close-on-exec); the caller owns the fd."""
    return os.memfd_create(name[:200], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)


#: Below this, reserving is not worth a look at the machine's free memory first (~0.1 ms).
_PRECHECK_BYTES = 4 << 20


def reserve(fd: int, nbytes: int, what: str) -> None:
    """Size `fd` and reserve its pages now: short memory fails here, never as SIGBUS later.

    memfd pages are not bounded by a tmpfs size, so a large request is first held
    against what the machine (or the memory cgroup) has left: posix_fallocate past
    that would push the machine into the OOM killer rather than fail.
    """
    if nbytes >= _PRECHECK_BYTES:
        room = memory_available()
        if room is not None and nbytes > room[0]:
            raise _short_of_memory(nbytes, what)
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
            raise _short_of_memory(nbytes, what) from None
        raise ResourceError(f"cannot create shared memory for {what}: {exc}") from None


def seal(fd: int) -> None:
    """Fix the memfd's size for good (F_SEAL_SHRINK | F_SEAL_GROW), and the seals themselves."""
    fcntl.fcntl(fd, _F_ADD_SEALS, SEALS)


def check_sealed(fd: int, nbytes: int | None = None) -> None:
    """Client side: map only a regular file whose size is sealed and is the size promised."""
    try:
        st = os.fstat(fd)
        seals = fcntl.fcntl(fd, _F_GET_SEALS)  # EINVAL: not a memfd (a file that could shrink)
    except OSError as exc:
        raise InvalidField(f"the daemon sent an fd that is not a sealed memfd ({exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidField("the daemon sent an fd that is not a regular file")
    if seals & _SIZE_SEALS != _SIZE_SEALS:
        raise InvalidField(f"the daemon sent a memfd whose size is not sealed (seals {seals:#x})")
    if nbytes is not None and st.st_size != nbytes:
        raise InvalidField(f"the daemon sent a memfd of {st.st_size} bytes, expected {nbytes}")


class ShmFile:
    """One mapped shared-memory segment (a sealed memfd), seen as a flat uint8 array."""

    __slots__ = ("name", "nbytes", "_mmap", "array", "_closed", "fd")

    def __init__(self, name: str, nbytes: int, mm: mmap.mmap, fd: int = -1) -> None:
        self.name = name
        self.nbytes = nbytes
        self._mmap = mm
        self.array: np.ndarray = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        self._closed = False
        #: The memfd, until `take_fd` hands it on (the daemon's, to pass to its client).
        self.fd = fd

    @property
    def address(self) -> int:
        """The mapping's address in this process (for hostRegister / NIXL)."""
        return int(self.array.ctypes.data)

    @classmethod
    def create(cls, name: str, nbytes: int) -> "ShmFile":
        """Daemon side: a new sealed memfd of exactly `nbytes`, its pages reserved, mapped."""
        fd = new_memfd(name)
        try:
            reserve(fd, nbytes, f"a {nbytes}-byte segment")
            seal(fd)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, nbytes, mm, fd)

    @classmethod
    def attach(cls, fd: int, nbytes: int) -> "ShmFile":
        """Client side: map a memfd received from the daemon. Takes the fd (closes it)."""
        try:
            check_sealed(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls("attached", nbytes, mm)

    def take_fd(self) -> int:
        """Hand the memfd on (it is the taker's to close); the mapping stays."""
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        """Unmap. Views handed out keep the mapping alive until they are gone."""
        if self._closed:
            return
        self._closed = True
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.array = np.empty(0, np.uint8)
        try:
            self._mmap.close()
        except BufferError:
            # A NumPy view still references the mapping; it is unmapped when that view dies.
            pass


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class DaemonLock:
    """An flock held for the daemon's life; marks its files as live for sweepers."""

    def __init__(self, dirpath: Path) -> None:
        self.instance = secrets.token_hex(8)  # 64 bits: names built on it cannot be guessed ahead
        self.path = dirpath / f"{PREFIX}{self.instance}.lock"
        # Lock under a name sweepers ignore, then rename: a sweeper never sees it unlocked.
        tmp = dirpath / f".{PREFIX}{self.instance}.lock.tmp"
        self._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, self.path)

    def release(self) -> None:
        if self._fd >= 0:
            _unlink(self.path)
            os.close(self._fd)
            self._fd = -1


def sweep_stale(dirpath: Path) -> list[str]:
    """Unlink files of daemon instances that are no longer alive; return their names."""
    removed: list[str] = []
    try:
        names = os.listdir(dirpath)
    except FileNotFoundError:
        return removed
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(".lock")):
            continue
        instance = name[len(PREFIX) : -len(".lock")]
        lock_path = dirpath / name
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue  # another user's daemon: not ours to judge
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its daemon is alive
            prefix = f"{PREFIX}{instance}."
            for other in os.listdir(dirpath):
                if other.startswith(prefix) and other != name:
                    _unlink(dirpath / other)
                    removed.append(other)
            _unlink(lock_path)
            removed.append(name)
        finally:
            os.close(fd)
    return removed
