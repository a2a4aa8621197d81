"""A graph's stretch on one GPU, run by a session's ring worker: captured once into a CUDA
graph on the worker's stream, then replayed with one launch per run.

`StreamBackend.inline_steps` makes a `Replay` for a kept graph run whose operands all lie in
the device's memory (server/_inline.py keeps it; the worker calls it for each RUN_GRAPH
with those VAs). A call:

1. takes the worker's stream on the device (`Worker.device_stream`: the run's completion then
   waits for that stream's event, as a device copy's does, and a driver error fails it with
   `DeviceFault`);
2. the first time, captures the stretch on that stream (`Backend._capture`): nothing runs,
   the kernels are recorded; the graph is instantiated. A capture that fails (a kernel that
   allocates: the capture runs under an allocator that refuses, or a driver without graphs)
   makes this replay run its kernels one by one on the stream at every call instead, counted
   (`graph_eager_runs`);
3. launches the graph: one call (`graph_replays`).

Nothing is synchronized and no event is made here: the worker records its own event behind
the launch and answers once it has passed. The memory a launch touches is held by the worker
until then (`Worker.hold`, by segment), so a free waits for the launch; and every change of
the table drops the replay (`InlineRuns.clear`), so no capture outlives the memory it names.

Kernels that run as host functions (the stream simulation over the fake driver, where
"device" memory is host memory) are named by a key in `_HOST`, not by an object the driver
holds: a replay dropped while a launch is in flight keeps its keys until the launch's last
host function (`_Marker`) has run.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
from typing import Any, Callable

from .. import _native

__all__ = ["Replay", "host_key", "host_keys_live"]

log = logging.getLogger("transfer.replay")

#: Host functions queued or captured, by key (their driver thread calls `_dispatch(key)`).
_HOST: dict[int, Callable[[], None]] = {}
_keys = itertools.count(1)
_dispatcher_set = False
_lock = threading.Lock()


def _dispatch(key: int) -> None:
    fn = _HOST.get(key)
    if fn is None:  # (cannot happen while the markers keep keys: a bug, said loudly)
        log.error("a host function ran after its replay was dropped (key %d)", key)
        return
    fn()


def host_key(fn: Callable[[], None]) -> int:
    """A key for `fn` that the driver's host functions can name."""
    global _dispatcher_set
    with _lock:
        if not _dispatcher_set:
            _native.cuda_host_dispatcher(_dispatch)
            _dispatcher_set = True
        key = next(_keys)
    _HOST[key] = fn
    return key


def host_keys_live() -> int:
    """Host functions registered now (tests: every dropped replay gives its keys back)."""
    return len(_HOST)


class Replay:
    """One stretch on one device, bound to its memory: captured at its first run, replayed after."""

    def __init__(self, backend: Any, calls: list[Any], ordinal: int, counters: dict[str, int]) -> None:
        self.backend, self.calls, self.ordinal, self.counters = backend, calls, ordinal, counters
        self.exec: Any = None
        self.eager = False
        self.inflight = 0
        self.closed = False
        self.keys: list[int] = []
        if backend.host_kernels:  # the kernels are host functions: keys, and a marker that ends each launch
            self.keys = [host_key(c) for c in calls] + [host_key(self._launch_done)]

    def __call__(self, worker: Any) -> tuple[float, None]:
        stream = worker.device_stream(self.ordinal)
        c = self.counters
        if self.exec is None and not self.eager:
            self.exec = self._capture(stream)
            self.eager = self.exec is None
            c["graph_captures" if self.exec is not None else "graph_capture_failures"] += 1
        self.inflight += 1
        if self.exec is not None:
            self.backend._replay(self, stream)
            c["graph_replays"] += 1
        else:
            self.backend._eager(self, stream)
            c["graph_eager_runs"] += 1
        return 0.0, None  # (nothing known here: the device answers through the worker's event)

    def _capture(self, stream: int) -> Any:
        enabled = gc.isenabled()
        gc.disable()  # (a collection inside the capture could free device memory: not capturable)
        try:
            return self.backend._capture(self, stream)
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager launches, counted
            log.info("graph run on device %d not captured (%s): its kernels are launched one by one", self.ordinal, exc)
            return None
        finally:
            if enabled:
                gc.enable()

    def _launch_done(self) -> None:
        self.inflight -= 1
        if self.closed and not self.inflight:
            self._release()

    def close(self) -> None:
        """Dropped (the table changed): what it holds goes once no launch of it is in flight."""
        self.closed = True
        if not self.inflight or not self.keys:
            self._release()

    def _release(self) -> None:
        for k in self.keys:
            _HOST.pop(k, None)
        self.keys = []
        x, self.exec = self.exec, None
        if x is not None:
            self.backend._free_graph(self, x)
