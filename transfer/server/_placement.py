"""Virtual devices and the placement policies that choose among them.

Next to the planner because placement is one of its decisions: device
memory decides where work runs; for host-only work a policy does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

__all__ = [
    "VirtualDevice", "Placement", "SizePlacement", "LeastLoaded", "RoundRobin", "CostPlacement", "POLICIES", "make_policy",
    "choose_home",
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
    """Chooses a device for work whose operands are all host memory.

    `nbytes`: the bytes its operands span (what would move to a device); `work`: the
    bytes of elements its kernel touches (0 for copies and fills: `nbytes` then)."""

    name = "base"

    def choose(self, devices: Sequence[VirtualDevice], nbytes: int, work: int = 0) -> VirtualDevice:
        raise NotImplementedError

    def fixed(self, devices: Sequence[VirtualDevice], nbytes: int) -> bool:
        """Whether `choose` gives the same device for these bytes whatever the load (a plan
        that placed such work may be kept: server/_graphrun.py)."""
        return False


class SizePlacement(Placement):
    """Small inputs to a CPU device, large ones to a GPU (when there is one)."""

    name = "size"

    def __init__(self, threshold: int = 1 << 20) -> None:
        self.threshold = threshold

    def choose(self, devices: Sequence[VirtualDevice], nbytes: int, work: int = 0) -> VirtualDevice:
        return min(self._pool(devices, nbytes), key=lambda d: d.queued_bytes)

    def fixed(self, devices: Sequence[VirtualDevice], nbytes: int) -> bool:
        return len(self._pool(devices, nbytes)) == 1

    def _pool(self, devices: Sequence[VirtualDevice], nbytes: int) -> list[VirtualDevice]:
        want = "cpu" if nbytes < self.threshold else "gpu"
        return [d for d in devices if d.kind == want] or list(devices)


class LeastLoaded(Placement):
    name = "least-loaded"

    def choose(self, devices: Sequence[VirtualDevice], nbytes: int, work: int = 0) -> VirtualDevice:
        return min(devices, key=lambda d: (d.queued_bytes, d.index))


class RoundRobin(Placement):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, devices: Sequence[VirtualDevice], nbytes: int, work: int = 0) -> VirtualDevice:
        return devices[next(self._next) % len(devices)]


class CostPlacement(Placement):
    """The device that finishes soonest: bytes moved to it, plus its queue, plus the work.

    Host operands reach a GPU over its link (`link` bytes/s, PCIe) and are read in place
    by a CPU; a device works through `rate` bytes of elements per second. So small work
    stays on a CPU (moving it costs more than computing it there), large work goes to a
    GPU, and a busy device loses to an idle one. The figures are estimates, per kind;
    only their ratios matter.
    """

    name = "cost"
    #: Element bytes per second a device of each kind works through.
    RATE = {"cpu": 5e9, "gpu": 300e9}
    #: Bytes per second host operands move to a device of each kind (None: read in place).
    LINK: dict[str, float | None] = {"cpu": None, "gpu": 12e9}
    #: Fixed cost of sending work to a device of each kind (a launch, a thread hop), seconds.
    LATENCY = {"cpu": 20e-6, "gpu": 50e-6}

    def cost(self, d: VirtualDevice, nbytes: int, work: int) -> float:
        """Estimated seconds until `d` would have finished this work."""
        rate = self.RATE.get(d.kind, self.RATE["cpu"])
        link = self.LINK.get(d.kind)
        moved = 0.0 if link is None else nbytes / link
        return self.LATENCY.get(d.kind, 0.0) + moved + (d.queued_bytes + (work or nbytes)) / rate

    def choose(self, devices: Sequence[VirtualDevice], nbytes: int, work: int = 0) -> VirtualDevice:
        return min(devices, key=lambda d: (self.cost(d, nbytes, work), d.index))


POLICIES: dict[str, Callable[[], Placement]] = {
    "size": SizePlacement,
    "least-loaded": LeastLoaded,
    "round-robin": RoundRobin,
    "cost": CostPlacement,
}


def make_policy(name: str, size_threshold: int = 1 << 20) -> Placement:
    if name == "size":
        return SizePlacement(size_threshold)
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown placement policy {name!r}; choose one of {', '.join(POLICIES)}") from None
