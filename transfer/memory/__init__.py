"""Segment kinds: shared memory (host), device buffers (backends/), remote (NIXL)."""

from ._shm import DaemonLock, ShmFile, default_shm_dir, sweep_stale

__all__ = ["ShmFile", "DaemonLock", "sweep_stale", "default_shm_dir"]
