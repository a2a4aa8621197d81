"""Virtual devices and the placement policies that choose among them.

Next to the planner because placement is one of its decisions: device
memory decides where work runs; for host-only work a policy does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "VirtualDevice", "Placement", "SizePlacement", "LeastLoaded", "RoundRobin", "POLICIES", "make_policy", "choose_home",
]


@dataclass(eq=False)
class VirtualDevice:
    """One physical device (a GPU, or the CPU) as the scheduler sees it."""

    index: int
    kind: str  # "cpu" or "gpu"
    backend: Any  # transfer.backends.Backend
    local_id: int = 0  # the backend's own device number
    queued_bytes: int = 0
    completed: int = 0
    info: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"<VirtualDevice {self.index} {self.kind}:{self.local_id} via {self.backend.name}>"


def choose_home(devices: Sequence[VirtualDevice], homed: Mapping[int, int]) -> VirtualDevice:
    """A new session's home device: where its buffers go unless it names a device.

    Chosen once per session, so eager and deferred allocations agree and a
    workload's buffers share one device (compute across devices is refused).
    The fastest kind present (GPUs before CPUs), the fewest allocated bytes,
    then the fewest sessions homed there (`homed`: device index -> count), then
    the lowest index.
    """
    kind = "gpu" if any(d.kind == "gpu" for d in devices) else "cpu"
    return min(
        (d for d in devices if d.kind == kind),
        key=lambda d: (d.info.get("bytes", 0), homed.get(d.index, 0), d.index),
    )


class Placement:
    """Chooses a device for work whose operands are all host memory."""

    name = "base"

    def choose(self, devices: Sequence[VirtualDevice], nbytes: int) -> VirtualDevice:
        raise NotImplementedError


class SizePlacement(Placement):
    """Small inputs to a CPU device, large ones to a GPU (when there is one)."""

    name = "size"

    def __init__(self, threshold: int = 1 << 20) -> None:
        self.threshold = threshold

    def choose(self, devices: Sequence[VirtualDevice], nbytes: int) -> VirtualDevice:
        want = "cpu" if nbytes < self.threshold else "gpu"
        pool = [d for d in devices if d.kind == want] or list(devices)
        return min(pool, key=lambda d: d.queued_bytes)


class LeastLoaded(Placement):
    name = "least-loaded"

    def choose(self, devices: Sequence[VirtualDevice], nbytes: int) -> VirtualDevice:
        return min(devices, key=lambda d: (d.queued_bytes, d.index))


class RoundRobin(Placement):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, devices: Sequence[VirtualDevice], nbytes: int) -> VirtualDevice:
        return devices[next(self._next) % len(devices)]


POLICIES: dict[str, Callable[[], Placement]] = {
    "size": SizePlacement,
    "least-loaded": LeastLoaded,
    "round-robin": RoundRobin,
}


def make_policy(name: str, size_threshold: int = 1 << 20) -> Placement:
    if name == "size":
        return SizePlacement(size_threshold)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; choose one of {', '.join(POLICIES)}") from None
