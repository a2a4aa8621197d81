"""A planner's world for in-process tests of the pass (tests/unit/server/test_scheduler.py,
tests/integration/test_streamsim.py): two host segments and one device buffer, on NumPy or on
the stream simulation with a CPU device beside it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from transfer.addressing import MappingTable, SegmentKind
from transfer.backends import NumpyBackend
from transfer.backends._streamsim import SimMemory, StreamSimBackend
from transfer.server._placement import VirtualDevice, make_policy
from transfer.server._planner import Planner

SIZES = [4096, 8192, 3000]  # two host segments and one device buffer per test


BACKENDS = ["numpy", "streamsim"]


#: The CPU backends the worlds share (each starts device processes at its first kernel) and
#: the memory the last world allocated from them, freed when the next world is made.
_CPU: dict[int, NumpyBackend] = {}
_LIVE: list[tuple[NumpyBackend, Any]] = []


def cpu_backend(n: int) -> NumpyBackend:
    if n not in _CPU:
        _CPU[n] = NumpyBackend(n)
    return _CPU[n]


def close_cpu_backends() -> None:
    """Close the shared CPU backends (their device processes) and forget the last world's memory."""
    for b in _CPU.values():
        b.close()
    _CPU.clear()
    _LIVE.clear()


def make_world(n_devices: int = 2, backend_name: str = "numpy"):
    """Two host segments and one device buffer; with streamsim, a simulated GPU and a CPU device
    (as the daemon builds them), so host-only work is placed on either. Host memory is the CPU
    backend's (memfds its device processes map), seen as a host segment."""
    while _LIVE:
        owner, m = _LIVE.pop()
        owner.free(m)
    if backend_name == "streamsim":
        sim = StreamSimBackend(1)
        cpu = cpu_backend(1)
        devices = [VirtualDevice(0, "gpu", sim, 0), *(VirtualDevice(i, "cpu", cpu, 0) for i in range(1, n_devices))]
        backend: Any = sim
    else:
        backend = cpu = cpu_backend(n_devices)
        devices = [VirtualDevice(i, "cpu", backend, i) for i in range(n_devices)]
    table: MappingTable = MappingTable()
    mem = []
    for k, n in enumerate(SIZES):
        if k < 2:
            arr = cpu.alloc(n, 0)
            _LIVE.append((cpu, arr))
            table.add(SegmentKind.HOST, n, "s", SimpleNamespace(array=arr))
        else:
            arr = backend.alloc(n, 0)
            if backend is cpu:
                _LIVE.append((cpu, arr))
            table.add(SegmentKind.DEVICE, n, "s", arr, device=0)
        mem.append(arr)
    planner = Planner(table, devices, make_policy("round-robin"), {})
    return planner, devices, mem


def load(m: Any, data: np.ndarray) -> None:
    if isinstance(m, SimMemory):
        m.data[:] = data  # nothing queued yet
    else:
        m[:] = data


def contents(m: Any) -> np.ndarray:
    """A segment's bytes as the host sees them: device memory read through its (checked) view."""
    return m.backend.read(m) if isinstance(m, SimMemory) else m


def va(seg: int, off: int) -> int:
    return ((seg + 1) << 40) | off
