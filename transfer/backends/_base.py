"""The small interface every device backend implements.

The scheduler hands a backend *translated* ranges only: (memory, offset,
nbytes) triples whose bounds the mapping table has already checked. A
backend never sees a VA, a session or a wire message.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, Callable, ContextManager, Hashable, NamedTuple, Sequence

from ..addressing import SegmentKind
from ..kernels import run_steps

__all__ = ["Backend", "Span"]


class Span(NamedTuple):
    """A checked byte range: `mem` is a ShmFile (HOST) or the backend's own memory (DEVICE)."""

    kind: SegmentKind
    mem: Any
    offset: int
    nbytes: int


class Backend(abc.ABC):
    """A physical device family (CPU via NumPy, GPU via CuPy)."""

    name: str
    #: Kernels run in another process (`begin_compute` only sends them): the daemon's loop
    #: never waits for them, a worker does (`server._ops.runs_inline`).
    out_of_process = False

    @property
    @abc.abstractmethod
    def device_count(self) -> int: ...

    @abc.abstractmethod
    def alloc(self, nbytes: int, device: int) -> Any:
        """Zeroed device memory of `nbytes` (zeroed: it may have held another session's data)."""

    @abc.abstractmethod
    def free(self, mem: Any) -> None: ...

    def host_buffer(self, mem: Any) -> Any:
        """The host memory behind a device allocation, if that is all it is (a writable buffer
        a native ring worker may copy into), else None: real device memory goes through the pass."""
        return None

    def register_host(self, shm: Any) -> None:
        """A new host segment: this backend may make it DMA-able (pinned); no-op where meaningless."""

    def unregister_host(self, shm: Any) -> None:
        """Undo register_host before the segment is unmapped."""

    @abc.abstractmethod
    def copy(self, dst: Span, src: Span) -> None:
        """Copy src.nbytes bytes; overlapping ranges behave like memmove."""

    @abc.abstractmethod
    def fill(self, dst: Span, value: int) -> None: ...

    @abc.abstractmethod
    def checksum(self, src: Span) -> int:
        """checksum64 of the range, read in place."""

    def synchronize(self) -> None:
        """Wait until all submitted work is done (no-op for synchronous backends)."""

    def synchronize_device(self, device: int) -> None:
        """Wait for one device's submitted work (every lane of it)."""

    #: Host bytes page-locked for DMA right now.
    pinned_bytes = 0

    def all_pinned(self) -> bool:
        """Whether device copies of any host segment queue without blocking (stream backends)."""
        return False

    def off_loop(self) -> ContextManager[None]:
        """Mark the calling thread a worker: it may block on slow driver calls (pinning)."""
        return contextlib.nullcontext()

    def lane(self, lane: Hashable) -> ContextManager[None]:
        """Queue the calling thread's device work on `lane` (a stream of its own); see _stream."""
        return contextlib.nullcontext()

    def synchronize_lane(self, device: int, lane: Hashable) -> None:
        """Wait for the work queued on one lane of a device: the scheduler calls it as a wave ends."""
        self.synchronize_device(device)

    def forget_lanes(self, owner: Any) -> None:
        """The lanes `(owner, n)` will not be used again (a session ended)."""

    @abc.abstractmethod
    def compute(self, kernel: Any, inputs: list[tuple[Any, Span]], outputs: list[tuple[Any, Span]], params: Any, device: int) -> Any:
        """Run a registry kernel on (TensorRef, Span) operands; return its result (or None)."""

    def begin_compute(self, kernel: Any, inputs: list[tuple[Any, Span]], outputs: list[tuple[Any, Span]], params: Any,
                      device: int) -> Callable[[], Any]:
        """Start `compute`; returns what waits for its result (here: it ran already)."""
        result = self.compute(kernel, inputs, outputs, params, device)
        return lambda: result

    def begin_steps(self, steps: Sequence[Any], failed: set[int], device: int) -> Callable[[], list[tuple[int, Any, float]]]:
        """Start a stretch of a graph's nodes on one device, in order; returns what waits for
        their outcomes (`kernels.run_steps`: per node; `failed`, the nodes that failed before,
        gains this stretch's failures). Here they run at once, one `compute` after another; a
        backend whose kernels run elsewhere (the CPU devices' processes) only queues them."""
        out = run_steps(steps, failed, lambda kernel, ins, outs, params: self.compute(kernel, ins, outs, params, device))
        return lambda: out

    def close(self) -> None:
        """Release what the backend holds beyond its memory (the CPU devices' processes)."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "devices": self.device_count}
