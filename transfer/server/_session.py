"""Sessions: one per client connection, owning its segments and its queue."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from .. import protocol as P

__all__ = ["Session", "SessionStats"]

_ids = itertools.count(1)


@dataclass
class SessionStats:
    frames: int = 0
    requests: int = 0
    errors: int = 0
    bytes_moved: int = 0
    #: Frames the client blocked on (it marks them with a Wait request).
    blocking: int = 0
    #: Deferred definitions received (allocations, frees, tensors, plans).
    defines: int = 0

    def to_wire(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class Session:
    identity: bytes
    client: str
    pid: int
    id: int = field(default_factory=lambda: next(_ids))
    last_seen: float = 0.0
    host_bytes: int = 0
    device_bytes: int = 0
    segments: set[int] = field(default_factory=set)
    #: Deferred-allocation arenas: device -> (first segment id, count).
    arenas: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: Cached definitions: (kind, client id) -> (version, value, creation site).
    defs: dict[tuple[str, int], tuple[int, Any, str]] = field(default_factory=dict)
    #: Other sessions' segments this one attached to (Share/Attach).
    attached: set[int] = field(default_factory=set)
    stats: SessionStats = field(default_factory=SessionStats)
    #: Requests waiting for a scheduler pass, in arrival order.
    queue: deque[P.Decoded] = field(default_factory=deque)
    #: Requests queued or running (checked against the credits announced in hello).
    inflight: int = 0
    wake: trio.Event = field(default_factory=trio.Event)
    #: Set at shutdown: finish what is queued, then end.
    draining: bool = False
    #: A pass is executing (on a worker thread): new frames wait for the session task.
    busy: bool = False
    #: perf_counter() when the oldest queued request arrived (request latency metrics).
    arrived: float = 0.0
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: The pidfd watcher's scope (same-host clients), cancelled when the session ends.
    pid_watch: trio.CancelScope | None = None
    finished: trio.Event = field(default_factory=trio.Event)
    closing: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    #: The session's shared-memory request ring (transfer._ring.Ring), if it opened one.
    ring: Any = None
    #: Descriptors popped from the ring and not yet answered (they hold completion slots).
    ring_pending: int = 0

    def __hash__(self) -> int:
        return self.id
