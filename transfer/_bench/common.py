"""Shared definitions: sizes, cell configuration, fresh batch contents, checksum."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Callable, Protocol, TypeAlias

import numpy as np

from .._units import fmt_bytes, parse_size as _parse_size

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

#: Clock used by every process (CLOCK_MONOTONIC on Linux: comparable across processes).
now = time.perf_counter

#: Words (uint64) between two stamped words when a producer writes fresh contents:
#: one word per 4 KiB page, so every page of every batch changes.
STAMP_STRIDE_WORDS = 512

METHODS_ALL = ("transfer", "transfer-socket", "shm-pipe", "iceoryx2", "torch-mp", "zmq-copy", "zmq-zerocopy", "mp-queue", "mp-pipe", "nixl-raw")
#: shm-pipe is the floor: what a user writes in an afternoon; iceoryx2 (zero-copy IPC
#: middleware) and torch-mp what users pick (each skipped with a note when not installed).
METHODS_QUICK = ("transfer", "shm-pipe", "iceoryx2", "torch-mp", "zmq-copy", "zmq-zerocopy")
MODES_ALL = ("local", "compute", "remote", "gpu", "latency", "share", "registration")

#: Methods that run in every mode but ``remote``; ``remote`` has its own baseline.
METHODS_REMOTE = ("transfer", "nixl-raw")

#: The daemon of every mode but ``gpu``: every baseline there copies host to host, so
#: ``transfer`` does too. On a GPU host ``--backend auto`` would place its destination
#: (``alloc``) on the GPU, which is the gpu mode's work.
HOST_DAEMON_ARGS = ("--backend", "numpy")


def method_runs_in(method: str, mode: str) -> bool:
    """Whether ``method`` has a meaningful ``mode`` cell.

    ``remote``: the producer's own (non-shared) memory, read over NIXL: only
    ``transfer`` (a tcp session, as from another host; the daemon READs) and
    ``nixl-raw`` (a consumer READs) apply.
    ``nixl-raw`` is the baseline of ``remote`` only.
    """
    if mode == "remote":
        return method in METHODS_REMOTE
    return method != "nixl-raw"

def method_available(method: str) -> tuple[bool, str]:
    """Methods that need a package this machine may not have: (available, why not)."""
    if method == "torch-mp":
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            return False, "method torch-mp: PyTorch is not installed (pip install torch): skipped"
    if method == "iceoryx2":
        # Imported, not only found: the package is a native extension that may fail to load.
        try:
            import iceoryx2  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return False, (f"method iceoryx2: iceoryx2 is not importable ({type(e).__name__}: {e}; "
                           "pip install 'transfer[bench]'): skipped")
    return True, ""


METHOD_LABELS = {
    "transfer": "transfer (shm + VA requests; the ring, by default on the same host)",
    "transfer-socket": "transfer with ring=False (every request over the control socket)",
    "zmq-copy": "pyzmq PUSH/PULL ipc copy=True",
    "zmq-zerocopy": "pyzmq PUSH/PULL ipc copy=False",
    "mp-queue": "multiprocessing.Queue",
    "mp-pipe": "multiprocessing.Pipe, pickle 5 out-of-band",
    "shm-pipe": "hand-rolled shm + pipe notify",
    "torch-mp": "torch.multiprocessing: a shared tensor, queue notify",
    "iceoryx2": "iceoryx2 publish-subscribe: loaned samples, event notify",
    "nixl-raw": "raw NIXL READ by a consumer process (remote mode)",
    "limit:memcpy": "in-process memcpy (one core)",
    "limit:read": "in-process u64 read (one core)",
    "limit:checksum": "in-process checksum64 (one core)",
}


#: What a checksum reads: an array or any bytes-like object.
Bytes: TypeAlias = "np.ndarray | bytes | bytearray | memoryview"
#: A channel's plumbing for one process (endpoints, pipes, queues): picklable, keys per method.
Spec: TypeAlias = dict[str, Any]
#: A measurement's record (a cell's result, a process's stats): JSON-shaped, keys per kind.
Record: TypeAlias = dict[str, Any]
#: Per size, per limit (``limit:memcpy`` ...): its measured record.
Limits: TypeAlias = dict[int, dict[str, Record]]
#: What a consumer receives per group: producer, group, slot, flags, expected checksums, items.
Received: TypeAlias = "tuple[int, int, int, int, Sequence[int] | None, list[np.ndarray]]"


class Producer(Protocol):
    """A producer's end of a channel, as the generic loop (``workers``) drives it."""

    @property
    def buffer(self) -> np.ndarray | None:
        """``depth`` slots of ``batch`` items, or None where each group's memory is loaned."""

    def submit(self, g: int, slot: int, verify: bool, expected: Sequence[int] | None) -> None: ...

    def poll(self, block: bool) -> list[tuple[int, bool]]: ...

    def bye(self) -> None: ...

    def close(self) -> None: ...


class Consumer(Protocol):
    """A consumer's end of a channel: ``recv`` a group, ``ack`` it (producer, group, ok)."""

    def recv(self) -> Received: ...

    def ack(self, idx: int, g: int, ok: bool) -> None: ...

    def close(self) -> None: ...


class BenchFailure(RuntimeError):
    """The benchmark could not produce a trustworthy result (mismatch, crash, hang)."""


def parse_size(text: str) -> int:
    """A benchmark size (read as `transfer._units.parse_size` reads one): a positive multiple of 8 bytes."""
    try:
        n = _parse_size(text)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (examples: 4K, 64KiB, 1M, 256MiB)") from None
    if n <= 0 or n % 8:
        raise ValueError(f"size must be a positive multiple of 8 bytes: {text!r}")
    return n


def parse_sizes(text: str) -> list[int]:
    if ".." in text:
        lo, hi = (parse_size(t) for t in text.split("..", 1))
        out, s = [], lo
        while s <= hi:
            out.append(s)
            s *= 4
        return out
    return [parse_size(t) for t in text.split(",") if t.strip()]


#: How the tables and progress lines print a size ("64 KiB").
fmt_size = fmt_bytes


def default_batch_items(size: int) -> int:
    """Requests per group: small items are sent in groups (one frame / message)."""
    return max(1, min(64, (256 * KiB) // size))


@dataclasses.dataclass(frozen=True)
class Cell:
    """One measured configuration."""

    method: str
    mode: str
    size: int  # bytes per request (item)
    producers: int
    depth: int  # groups in flight per producer
    batch: int  # items (requests) per group
    verify_every: int  # verify every Nth group (1 = all)
    corrupt_group: int = -1  # test hook: the producer damages this group after checksumming it

    @property
    def slot_bytes(self) -> int:
        return self.size * self.batch

    @property
    def buffer_bytes(self) -> int:
        return self.slot_bytes * self.depth

    def describe(self) -> str:
        b = f" x{self.batch}" if self.batch > 1 else ""
        return (f"{self.method:<13} {self.mode:<7} {fmt_size(self.size):>8}{b:<4} "
                f"P={self.producers} D={self.depth}")


def get_checksum() -> tuple[Callable[[Bytes], int], str]:
    """The checksum every method uses: transfer's own (the daemon's)."""
    from transfer import checksum64

    return checksum64, "transfer.checksum64"


def item_views(buf: np.ndarray, cell: Cell) -> list[list[np.ndarray]]:
    """uint8 views [slot][item] over a producer buffer of ``cell.buffer_bytes``."""
    S, K = cell.size, cell.batch
    return [[buf[(d * K + i) * S:(d * K + i + 1) * S] for i in range(K)] for d in range(cell.depth)]


def stamp(u64: np.ndarray, seed: int) -> None:
    """Fresh contents, cheaply: a per-batch seed in one word of every page plus the last word."""
    u64[::STAMP_STRIDE_WORDS] = seed
    u64[-1] = seed ^ 0x5A5A5A5A5A5A5A5A
