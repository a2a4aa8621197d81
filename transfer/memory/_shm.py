"""Shared-memory segments: our own mmap over files in /dev/shm.

Not `multiprocessing.shared_memory`: on Python 3.11 its resource tracker
unlinks segments when an *attaching* process exits (DESIGN.md pitfalls).

Lifecycle, chosen so that no file outlives its owners even after kill -9:

1. The daemon creates ``transfer.<instance>.<segment>.<random>`` with
   O_EXCL, mode 0600, and reserves its pages (posix_fallocate), so a full
   /dev/shm fails here with a clear error instead of SIGBUS later.
2. The client opens it, maps it, and unlinks the name at once. From then on
   the memory lives exactly as long as one of the two mappings does.
3. The daemon unlinks again on free, session end and shutdown (ENOENT is
   fine), covering a client that died before step 2.
4. Each daemon holds an flock on ``transfer.<instance>.lock``. A starting
   daemon sweeps files of instances whose lock nobody holds: what a
   SIGKILLed daemon left between steps 1 and 2.
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

__all__ = ["ShmFile", "DaemonLock", "sweep_stale", "PREFIX", "default_shm_dir"]

PREFIX = "transfer."


def default_shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")


def _space(dirpath: Path) -> tuple[int, int]:
    st = os.statvfs(dirpath)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


class ShmFile:
    """One mapped shared-memory file, seen as a flat uint8 array."""

    __slots__ = ("path", "nbytes", "_mmap", "array", "_closed")

    def __init__(self, path: Path, nbytes: int, mm: mmap.mmap) -> None:
        self.path = path
        self.nbytes = nbytes
        self._mmap = mm
        self.array: np.ndarray = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        self._closed = False

    @property
    def address(self) -> int:
        """The mapping's address in this process (for hostRegister / NIXL)."""
        return int(self.array.ctypes.data)

    @classmethod
    def create(cls, dirpath: Path, instance: str, segment_id: int, nbytes: int) -> "ShmFile":
        path = dirpath / f"{PREFIX}{instance}.{segment_id}.{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                    free, total = _space(dirpath)
                    raise OutOfSharedMemory(
                        f"cannot reserve {nbytes} bytes of shared memory in {dirpath}: "
                        f"{free} bytes free of {total} (enlarge it, e.g. docker --shm-size, "
                        f"or point --shm-dir elsewhere)"
                    ) from None
                raise ResourceError(f"cannot create shared memory in {dirpath}: {exc}") from None
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        return cls(path, nbytes, mm)

    @classmethod
    def attach(cls, path: str, nbytes: int, expect_dir: Path | None = None) -> "ShmFile":
        """Client side: map the daemon's file, check it is what was promised, unlink the name."""
        p = Path(path)
        if not p.name.startswith(PREFIX) or (expect_dir is not None and p.parent != expect_dir):
            raise InvalidField(f"daemon sent an unexpected segment path {path!r}")
        fd = os.open(p, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise InvalidField(f"segment file {path} is not a private regular file of this user")
            if st.st_size != nbytes:
                raise InvalidField(f"segment file {path} has {st.st_size} bytes, expected {nbytes}")
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        _unlink(p)
        return cls(p, nbytes, mm)

    def unlink(self) -> None:
        _unlink(self.path)

    def close(self) -> None:
        """Unmap. Views handed out keep the mapping alive until they are gone."""
        if self._closed:
            return
        self._closed = True
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
        self.instance = secrets.token_hex(4)
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
