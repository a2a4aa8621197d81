"""The small interface every device backend implements.

The scheduler hands a backend *translated* ranges only: (memory, offset,
nbytes) triples whose bounds the mapping table has already checked. A
backend never sees a VA, a session or a wire message.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from typing import Any, Callable, ContextManager, Hashable, NamedTuple, Sequence

from .. import errors as E
from ..addressing import SegmentKind
from ..kernels import run_steps

__all__ = ["Answer", "Backend", "Span", "Then", "host_bytes"]


class Span(NamedTuple):
    """A checked byte range: `mem` is a ShmFile (HOST) or the backend's own memory (DEVICE)."""

    kind: SegmentKind
    mem: Any
    offset: int
    nbytes: int


def host_bytes(span: Span) -> Any:
    """The bytes of a host segment's span. A segment its owner freed while another session's
    request on it was in flight (a guest's) has no bytes left: that request fails SegmentFreed."""
    view = span.mem.array[span.offset : span.offset + span.nbytes]
    if view.nbytes != span.nbytes:
        raise E.SegmentFreed("its segment was freed (by its owner) while this request was in flight")
    return view


class Answer:
    """What a started run gives back (`Backend.begin_compute`, `begin_steps`): call it to wait
    for the result (a worker thread), or ask to be told once it is in (`on_done`: the event
    loop, which must never wait). `then(fn)` is the same answer, passed through `fn`.

    Why not `concurrent.futures.Future`: that one is made for an executor's bookkeeping
    (states, cancellation, a Condition per future); this is one lock and a list."""

    __slots__ = ("_lock", "_waiting", "_done", "_value", "_error", "_callbacks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = threading.Lock()  # held until the answer is in: a waiter blocks on it
        self._waiting.acquire()
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[], None]] = []

    @classmethod
    def ready(cls, value: Any) -> "Answer":
        answer = cls()
        answer.set(value)
        return answer

    def set(self, value: Any = None, error: BaseException | None = None) -> None:
        """(Once.) The result, or the error waiting raises; runs the `on_done` callbacks here."""
        with self._lock:
            self._value, self._error, self._done = value, error, True
            callbacks, self._callbacks = self._callbacks, []
        self._waiting.release()
        for callback in callbacks:
            callback()

    def on_done(self, callback: Callable[[], None]) -> None:
        """Call `callback()` once the answer is in: at once if it is, else on the thread that
        sets it (so it must be quick and thread-safe: `TrioToken.run_sync_soon`)."""
        with self._lock:
            if not self._done:
                self._callbacks.append(callback)
                return
        callback()

    def __call__(self) -> Any:
        if not self._done:
            self._waiting.acquire()  # (without the GIL)
            self._waiting.release()  # for the next waiter
        if self._error is not None:
            raise self._error
        return self._value

    def then(self, fn: Callable[[Any], Any]) -> "Then":
        return Then(self, fn)


class Then:
    """An `Answer` passed through `fn` when waited for."""

    __slots__ = ("_base", "_fn")

    def __init__(self, base: "Answer | Then", fn: Callable[[Any], Any]) -> None:
        self._base, self._fn = base, fn

    def __call__(self) -> Any:
        return self._fn(self._base())

    def on_done(self, callback: Callable[[], None]) -> None:
        self._base.on_done(callback)

    def then(self, fn: Callable[[Any], Any]) -> "Then":
        return Then(self, fn)


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

    #: The CUDA driver (`libcuda.so.1`, or the library TRANSFER_CUDA_DRIVER names) serves this
    #: backend's device memory, so the data plane's native workers may queue its copies
    #: (`server._dataplane`): "always" (a real GPU), "if-named" (only a driver named in the
    #: environment: the stream simulation over the test suite's fake driver), or "never".
    cuda_driver = "never"
    #: Host segments are page-locked by the native workers (on their first device copy), not here.
    pins_natively = False

    def cuda_pointer(self, mem: Any) -> tuple[int, int] | None:
        """(device pointer, CUDA ordinal) of a device allocation the CUDA driver knows, else None."""
        return None

    def lane_streams(self, lane: Hashable) -> dict[int, int]:
        """{CUDA ordinal: the CUstream of `lane` on that device}: a session's native worker queues
        its device work there, so the worker and this backend share one stream model (a socket
        request on the lane queues behind the ring's copies). Empty: the worker's own streams."""
        return {}

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

    def nixl_memory(self, mem: Any) -> tuple[int, int, str, int] | None:
        """Device memory as NIXL registers it: (address, bytes, "DRAM" or "VRAM", device id);
        None where it cannot be (a remote copy then goes through a host segment)."""
        return None

    def prioritize(self, owner: Any) -> None:
        """The lanes `(owner, n)` are a latency tenant's: their streams, made from now on, get
        the device's greatest priority (until `forget_lanes(owner)`)."""

    def forget_lanes(self, owner: Any) -> None:
        """The lanes `(owner, n)` will not be used again (a session ended)."""

    @abc.abstractmethod
    def compute(self, kernel: Any, inputs: list[tuple[Any, Span]], outputs: list[tuple[Any, Span]], params: Any, device: int) -> Any:
        """Run a registry kernel on (TensorRef, Span) operands; return its result (or None)."""

    def begin_compute(self, kernel: Any, inputs: list[tuple[Any, Span]], outputs: list[tuple[Any, Span]], params: Any,
                      device: int, block: bool = True) -> "Answer | Then":
        """Start `compute`; its result is the answer's (here: it ran already). With `block`
        False, a backend whose kernels run elsewhere raises BlockingIOError rather than wait
        to hand the work over (its process is not started, or its socket is full)."""
        return Answer.ready(self.compute(kernel, inputs, outputs, params, device))

    def begin_steps(self, steps: Sequence[Any], failed: set[int], device: int, block: bool = True) -> "Answer | Then":
        """Start a stretch of a graph's nodes on one device, in order; the answer is their
        outcomes (`kernels.run_steps`: per node; `failed`, the nodes that failed before, gains
        this stretch's failures). Here they run at once, one `compute` after another; a
        backend whose kernels run elsewhere (the CPU devices' processes) only queues them."""
        return Answer.ready(run_steps(steps, failed, lambda kernel, ins, outs, params: self.compute(kernel, ins, outs, params, device)))

    def inline_steps(self, steps: Sequence[Any], device: int, counters: dict[str, int]) -> Callable[[Any], tuple[float, Any]] | None:
        """A graph run's stretch as a call a ring's worker makes on its thread (`server._inline`):
        `call(worker)` runs it (its operands bound once) and returns what is known at once: its
        kernels' seconds and the run's error, or None (`kernels.run_through`); None where this
        backend cannot."""
        return None

    def read_answers_with(self, adopt: Callable[[Any], bool]) -> None:
        """(A backend whose kernels run elsewhere.) From now on, `adopt(channel)` is offered
        each new device process's answers (`_devproc.Channel`) to read: a daemon's event loop
        reads them itself. If it declines (False), a thread reads them."""

    def close(self) -> None:
        """Release what the backend holds beyond its memory (the CPU devices' processes)."""

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "devices": self.device_count}
