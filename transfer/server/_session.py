"""Sessions: one per client connection, owning its segments and its queue.

A session's lifecycle is one explicit state machine (`Phase`)::

    OPEN ──Close / reclaim──▶ CLOSING ──released──▶ CLOSED
      │                          ▲
      └──daemon shutdown──▶ DRAINING ──queue empty──▶ CLOSED

OPEN accepts and runs requests. DRAINING (the daemon is stopping) runs what
is queued and accepts nothing new. CLOSING runs nothing more: what is queued
is answered `SessionClosed`. CLOSED owns nothing. Any other move is a bug
and raises.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

__all__ = ["Session", "SessionStats", "Phase"]

_ids = itertools.count(1)


class Phase(enum.Enum):
    OPEN = "open"
    DRAINING = "draining"
    CLOSING = "closing"
    CLOSED = "closed"


_MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.OPEN: frozenset((Phase.DRAINING, Phase.CLOSING, Phase.CLOSED)),
    Phase.DRAINING: frozenset((Phase.CLOSING, Phase.CLOSED)),
    Phase.CLOSING: frozenset((Phase.CLOSED,)),
    Phase.CLOSED: frozenset(),
}


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
    #: Device time its requests took, in nanoseconds: the ring worker's device work, timed by
    #: events on its stream, and graph runs the worker ran on a CPU device (their kernels).
    device_ns: int = 0

    def to_wire(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class Session:
    identity: bytes
    client: str
    pid: int
    id: int = field(default_factory=lambda: next(_ids))
    phase: Phase = Phase.OPEN
    #: The connection came over the CURVE-authenticated tcp socket (another host).
    remote_peer: bool = False
    #: Hello's priority (protocol.PRIORITY_*): a latency tenant's device streams get the
    #: device's greatest priority.
    priority: int = 0
    last_seen: float = 0.0
    host_bytes: int = 0
    device_bytes: int = 0
    segments: set[int] = field(default_factory=set)
    #: Where `alloc(device=-1)` puts buffers, eager or deferred; chosen once at hello (-1: none yet).
    home_device: int = -1
    #: Deferred-allocation arenas: device -> (first segment id, count).
    arenas: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: Cached definitions: (kind, client id) -> (version, value, creation site).
    defs: dict[tuple[str, int], tuple[int, Any, str]] = field(default_factory=dict)
    #: Other sessions' segments this one attached to (Share/Attach).
    attached: set[int] = field(default_factory=set)
    stats: SessionStats = field(default_factory=SessionStats)
    #: The batch form: (request, route) pairs waiting for a pass, in arrival order.
    queue: deque[tuple[Any, int]] = field(default_factory=deque)
    #: Socket requests queued or running (checked against the credits announced in hello).
    inflight: int = 0
    #: Ring requests taken and not yet answered (each holds a completion slot).
    ring_pending: int = 0
    #: A CopyV's descriptor chain taken in part (the rest was not in the ring yet), or None.
    ring_chain: Any = None
    #: Control frames of this session dealt with, hello included (`FLAG_AFTER` counts them).
    frames_seen: int = 0
    #: The highest frame count a descriptor of its ring has waited for: the descriptors after
    #: it follow the same frames.
    ring_fence: int = 0
    #: Descriptors taken from the ring that wait for a frame not read yet (`FLAG_AFTER`), or None.
    ring_held: Any = None
    #: A pass taken from the queue and not yet finished (planned, or executing on a worker).
    current: Any = None
    #: Pipelined passes: queued on a GPU lane, answered in order as their fences pass.
    pipeline: deque[Any] = field(default_factory=deque)
    #: The pipeline's first passes, sent to a CPU device's process: (batch, `_waves.Sent`).
    sent: deque[Any] = field(default_factory=deque)
    pipeline_wake: trio.Event = field(default_factory=trio.Event)
    #: Set (and replaced) each time a pipelined pass is answered.
    pipeline_moved: trio.Event = field(default_factory=trio.Event)
    wake: trio.Event = field(default_factory=trio.Event)
    #: perf_counter() when the oldest queued request arrived (request latency metrics).
    arrived: float = 0.0
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: The pidfd watcher's scope (same-host clients), cancelled when the session ends.
    pid_watch: trio.CancelScope | None = None
    #: The client's process as this daemon sees it: its hello's pid until its first fd handover
    #: says otherwise (SO_PEERCRED: a client in a pid namespace of its own gave its own view).
    host_pid: int = 0
    finished: trio.Event = field(default_factory=trio.Event)
    info: dict[str, Any] = field(default_factory=dict)
    #: The session's shared-memory request ring (transfer._ring.Ring), if it opened one.
    ring: Any = None
    #: The pipe the daemon's end of the ring rings when the client sleeps on completions.
    ring_bell: Any = None
    #: A remote session's data channel (`transfer.ring._channel.Channel`) once connected;
    #: until then, what it waits for (`_channels.Awaited`: the ring's memfd and the key).
    channel: Any = None
    #: The native worker serving the ring (`_dataplane`), or None.
    worker: Any = None
    #: A socket frame arrived while the worker still had this request index to go: the
    #: socket requests wait (`Rings.catch_up`) until it has, so the ring's go first.
    ring_wait: int | None = None
    #: The frames queued while `ring_wait` is set: (frame number, where its requests begin, as
    #: a count of requests ever queued: `queue_taken` + the index in `queue`). What the worker
    #: hands over is placed ahead of the frames sent after it.
    waiting_frames: list[tuple[int, int]] = field(default_factory=list)
    #: Requests taken from the head of `queue` so far (the pass's): turns a waiting frame's
    #: count into an index in `queue`, however much was taken since it arrived.
    queue_taken: int = 0
    #: Set when the worker rings the bell for this session (a watched index, a handover).
    ring_moved: trio.Event = field(default_factory=trio.Event)
    #: The daemon is draining: the request index its client had published when the drain
    #: began. Descriptors before it are served; those after it are answered by the ring's
    #: close (ShuttingDown). None while no drain has begun.
    ring_cut: int | None = None

    def __hash__(self) -> int:
        return self.id

    def to(self, phase: Phase) -> None:
        """Move to `phase`; staying put is allowed, an illegal move is a bug."""
        if phase is self.phase:
            return
        if phase not in _MOVES[self.phase]:
            raise RuntimeError(f"session {self.id}: {self.phase.value} -> {phase.value} is not a legal move")
        self.phase = phase

    @property
    def accepting(self) -> bool:
        """New requests are taken only while OPEN."""
        return self.phase is Phase.OPEN

    @property
    def running(self) -> bool:
        """Queued requests still run (OPEN or DRAINING)."""
        return self.phase is Phase.OPEN or self.phase is Phase.DRAINING

    @property
    def idle(self) -> bool:
        return not self.queue and self.current is None and not self.pipeline
