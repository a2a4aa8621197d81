"""Sessions: one per client connection, owning its segments and its queue."""

from __future__ import annotations

import itertools
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
    bytes_copied: int = 0
    bytes_read: int = 0

    def to_wire(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class Session:
    identity: bytes
    client: str
    pid: int
    inbox_send: trio.MemorySendChannel[list[P.Decoded]]
    inbox_recv: trio.MemoryReceiveChannel[list[P.Decoded]]
    id: int = field(default_factory=lambda: next(_ids))
    last_seen: float = 0.0
    host_bytes: int = 0
    device_bytes: int = 0
    segments: set[int] = field(default_factory=set)
    stats: SessionStats = field(default_factory=SessionStats)
    cancel_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    finished: trio.Event = field(default_factory=trio.Event)
    closing: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:
        return self.id
