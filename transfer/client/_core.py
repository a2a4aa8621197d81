"""What the sync and trio clients share, with no I/O: ids, pending requests,
reply handling, and the local mirror of the session's segments.

The mirror is what makes addressing free: a segment knows its base VA and
size, so `seg.va + offset` names a byte without asking the daemon.
"""

from __future__ import annotations

import contextlib

import os
from typing import Any, Callable, ContextManager, Iterator, Protocol, Sequence, Union

import numpy as np

from .. import errors as E
from .. import protocol as P
from ..kernels import DTYPES, TensorRef, tensor_extent
from ..memory import ShmFile

__all__ = ["Addressed", "RequestMethods", "Pending", "ClientCore", "HostSegment", "DeviceBuffer", "SharedSegment", "Addressable", "resolve_va", "make_tensor"]


def make_tensor(owner: Any, shape: int | Sequence[int], dtype: Any, offset: int, strides: Sequence[int] | None) -> TensorRef:
    """A TensorRef inside `owner` (a segment or buffer), bounds-checked locally."""
    dt = np.dtype(dtype)
    if dt.name not in DTYPES:
        raise TypeError(f"dtype {dt} is not supported on the wire; use one of {', '.join(DTYPES)}")
    shape_t = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(d) for d in shape)
    t = TensorRef(owner.va + offset, dt.name, shape_t, None if strides is None else tuple(int(x) for x in strides))
    if offset < 0 or offset + tensor_extent(t) > owner.nbytes:
        raise E.OutOfBounds(f"tensor {shape_t} {dt} at offset {offset} exceeds {owner.nbytes} bytes")
    return t


class HasVA(Protocol):
    va: int


Addressable = Union[int, HasVA]


def resolve_va(x: Addressable) -> int:
    va = x if type(x) is int else getattr(x, "va", None)
    if type(va) is not int:
        raise TypeError(f"expected a VA (int) or an object with .va, got {type(x).__name__}")
    return va


class Pending:
    """A request in flight. `result()` waits for it (driving the client's I/O)."""

    __slots__ = ("id", "_waiter", "_done", "_value", "_error", "_observed", "_callback", "_deps")

    def __init__(self, rid: int, waiter: Callable[["Pending", float | None], None]) -> None:
        self.id = rid
        self._waiter = waiter
        self._done = False
        self._value: Any = None
        self._error: E.TransferError | None = None
        self._observed = False
        self._callback: Callable[[Pending], None] | None = None
        #: Deferred definitions sent for this request: their failure is this request's failure.
        self._deps: list[Pending] | None = None

    def done(self) -> bool:
        return self._done

    def result(self, timeout: float | None = None) -> Any:
        err = self.exception(timeout)
        if err is not None:
            raise err
        return self._value

    def exception(self, timeout: float | None = None) -> E.TransferError | None:
        if not self._done:
            self._waiter(self, timeout)
        self._observed = True
        for dep in self._deps or ():
            if dep._error is not None:  # e.g. the deferred alloc this request touched was refused
                dep._observed = True
                return dep._error
        return self._error

    def _finish(self, value: Any, error: E.TransferError | None) -> None:
        self._done = True
        self._value = value
        self._error = error
        if self._callback is not None:
            self._callback(self)

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("failed" if self._error else "done")
        return f"<Pending #{self.id} {state}>"


class Addressed:
    """What every resource named by a VA shares: byte addresses and tensor descriptions.

    Subclasses set `va` and `nbytes`; both methods check bounds locally, with no round trip.
    """

    va: int
    nbytes: int

    def at(self, offset: int) -> int:
        """The VA of byte `offset` (plain arithmetic)."""
        if not 0 <= offset <= self.nbytes:
            raise E.OutOfBounds(f"offset {offset} is outside {type(self).__name__} of {self.nbytes} bytes")
        return self.va + offset

    def tensor(self, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0, strides: Sequence[int] | None = None) -> TensorRef:
        """Describe (not copy) a tensor here, for compute requests."""
        return make_tensor(self, shape, dtype, offset, strides)


class HostSegment(Addressed):
    """Shared memory mapped by this process and the daemon."""

    def __init__(self, client: Any, va: int, nbytes: int, shm: ShmFile) -> None:
        self._client = client
        self.va = va
        self.nbytes = nbytes
        self._shm: ShmFile | None = shm

    @property
    def buffer(self) -> np.ndarray:
        """The whole segment as a writable flat uint8 array (no copy)."""
        if self._shm is None:
            raise E.SegmentFreed(f"segment {self.va:#x} has been freed")
        return self._shm.array

    def ndarray(self, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0) -> np.ndarray:
        """A writable NumPy view of part of the segment: what the daemon reads in place."""
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise TypeError("object dtypes cannot live in shared memory")
        shape_t = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        count = int(np.prod(shape_t, dtype=np.int64)) if shape_t else 1
        nbytes = count * dt.itemsize
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise E.OutOfBounds(f"view of {nbytes} bytes at offset {offset} exceeds the segment's {self.nbytes} bytes")
        return np.ndarray(shape_t, dtype=dt, buffer=self.buffer, offset=offset)

    def _unmap(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None

    @property
    def freed(self) -> bool:
        return self._shm is None

    def __repr__(self) -> str:
        return f"<HostSegment va={self.va:#x} nbytes={self.nbytes}{' freed' if self.freed else ''}>"


class DeviceBuffer(Addressed):
    """Memory on one of the daemon's devices, named by its VA."""

    def __init__(self, client: Any, va: int, nbytes: int, device: int) -> None:
        self._client = client
        self.va = va
        self.nbytes = nbytes
        self.device = device

    def __repr__(self) -> str:
        return f"<DeviceBuffer va={self.va:#x} nbytes={self.nbytes} device={self.device}>"


class SharedSegment(Addressed):
    """Another session's segment or buffer this session attached to: addressable by VA, not mapped here."""

    def __init__(self, va: int, nbytes: int, kind: str, device: int) -> None:
        self.va = va
        self.nbytes = nbytes
        self.kind = kind
        self.device = device

    def __repr__(self) -> str:
        return f"<SharedSegment {self.kind} va={self.va:#x} nbytes={self.nbytes}>"


class RequestMethods:
    """Data requests both clients submit the same way; only `_submit` (and what it returns) differs."""

    _batch: list[P.Request] | None

    def _submit(self, cls: type[P.Request], *args: Any, objects: Sequence[Any] = (), blocking: bool = False) -> Any:
        raise NotImplementedError

    def _send(self, reqs: Sequence[P.Request]) -> None:
        raise NotImplementedError

    def _io_lock(self) -> ContextManager[Any]:
        """Held while touching the outgoing batch (the blocking client is thread-safe)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Requests submitted inside the block leave in one frame when it exits."""
        with self._io_lock():
            outer = self._batch
            if outer is None:
                self._batch = []
            try:
                yield
            finally:
                if outer is None:
                    reqs, self._batch = self._batch or [], None
                    if reqs:
                        self._send(reqs)

    def copy(self, dst: Addressable, src: Addressable, nbytes: int | None = None, *, stream: int = 0) -> Any:
        """Copy `nbytes` from `src` to `dst` inside the daemon (VAs or segments/buffers)."""
        if nbytes is None:
            sizes = [getattr(x, "nbytes") for x in (dst, src) if hasattr(x, "nbytes")]
            if not sizes:
                raise TypeError("nbytes is required when copying between plain VAs")
            nbytes = min(sizes)
        return self._submit(P.Copy, resolve_va(dst), resolve_va(src), nbytes, stream)

    def copy_many(self, dst: Sequence[int] | np.ndarray, src: Sequence[int] | np.ndarray, nbytes: Sequence[int] | np.ndarray, *, stream: int = 0) -> Any:
        """Many copies as one vector request; the daemon merges contiguous ones."""
        d, s, n = (np.asarray(x, dtype=np.uint64) for x in (dst, src, nbytes))
        if not (d.ndim == s.ndim == n.ndim == 1 and len(d) == len(s) == len(n)):
            raise ValueError("copy_many needs three 1-D sequences of equal length")
        return self._submit(P.CopyV, d, s, n, stream)

    def fill(self, dst: Addressable, nbytes: int, value: int = 0, *, stream: int = 0) -> Any:
        return self._submit(P.Fill, resolve_va(dst), nbytes, value, stream)

    def checksum(self, src: Addressable, nbytes: int | None = None, *, stream: int = 0) -> Any:
        """The daemon reads the range in place and answers its checksum64."""
        if nbytes is None:
            nbytes = int(getattr(src, "nbytes"))
        return self._submit(P.Checksum, resolve_va(src), nbytes, stream)

    def compute(
        self,
        op: Any,
        inputs: Sequence[Any],
        outputs: Sequence[Any] = (),
        params: dict[str, Any] | None = None,
        *,
        device: int = -1,
        placement: str = "",
        stream: int = 0,
    ) -> Any:
        """Run an operator on tensors named by VA (see transfer.OPERATORS).

        `op` is an operator name with TensorRefs, or a `Plan` with `Tensor` descriptors,
        in which case only their ids travel once the daemon has their definitions.
        """
        from ._deferred import Plan, Tensor

        if isinstance(op, Plan):
            if params:
                raise TypeError("a Plan carries its own parameters: use plan.set(...)")
            objs = [op, *inputs, *outputs]
            if not all(isinstance(t, Tensor) for t in objs[1:]):
                raise TypeError("compute with a Plan takes Tensor descriptors (client.tensor(...))")
            ref = lambda o: (o.id, o.version)  # noqa: E731
            return self._submit(P.ComputeRef, [ref(op)], [ref(t) for t in inputs], [ref(t) for t in outputs], stream, objects=objs)
        ins = [t.ref if isinstance(t, Tensor) else t for t in inputs]
        outs = [t.ref if isinstance(t, Tensor) else t for t in outputs]
        return self._submit(P.Compute, op, ins, outs, dict(params or {}), device, placement, stream)


class ClientCore:
    """Request ids, pending table, reply dispatch; no sockets."""

    def __init__(self, waiter: Callable[[Pending, float | None], None]) -> None:
        self._next_id = 1
        self.pending: dict[int, Pending] = {}
        self._waiter = waiter
        #: Failed requests; fence() raises the first one nobody called result() on.
        self.unobserved: list[Pending] = []
        self.limits = P.Limits()
        self.broken: E.TransferError | None = None
        self.pid = os.getpid()
        #: Deferred-creation state (arenas, pending definitions); None in eager mode.
        self.deferred: Any = None

    def prepare(self, cls: type[P.Request], args: tuple[Any, ...], objects: Sequence[Any] = (), blocking: bool = False) -> tuple[list[P.Request], Pending]:
        """The frame's worth of requests for one call: deferred definitions it needs first,
        the request, and a Wait marker when the caller will block on it."""
        self.check_usable()
        defs = self._definitions(cls, args, objects)
        req, pending = self.new(cls, *args)
        reqs = [*defs, req]
        if defs:
            pending._deps = [self.pending[d.id] for d in defs if d.id in self.pending]
        if blocking:
            marker, _ = self.new(P.Wait)
            self.pending.pop(marker.id, None)  # its reply only counts; nobody waits on it
            reqs.append(marker)
        return reqs, pending

    def _definitions(self, cls: type[P.Request], args: tuple[Any, ...], objects: Sequence[Any]) -> list[P.Request]:
        """Deferred definitions a request needs first: allocations it touches, descriptors it names."""
        from ._deferred import DeferredState

        state = self.deferred
        stale = [o for o in objects if o.sent_version != o.version]
        if state is None:
            if not stale:
                return []
            state = DeferredState(())
        elif not (state.buffers or state.frees or stale):
            return []
        return state.definitions_for(_touched(cls, args), stale, lambda c, *a: self.new(c, *a)[0])

    def new(self, cls: type[P.Request], *args: Any) -> tuple[P.Request, Pending]:
        rid = self._next_id
        self._next_id += 1
        req = cls(rid, *args)
        pending = Pending(rid, self._waiter)
        self.pending[rid] = pending
        return req, pending

    def encode(self, reqs: Sequence[P.Request]) -> list[bytes]:
        """One or more frames, each within the daemon's batch limit."""
        step = self.limits.max_batch
        return [P.encode_requests(reqs[i : i + step]) for i in range(0, len(reqs), step)]

    def on_frame(self, data: bytes) -> None:
        try:
            replies = P.decode_replies(data, self.limits)
        except E.ProtocolError as exc:
            self.fail_all(E.ProtocolError(f"undecodable reply from the daemon: {exc}"))
            return
        pending = self.pending
        for r in replies:
            if r.id == 0:
                # The daemon could not read one of our frames: nothing can be trusted now.
                self.fail_all(r.error or E.ProtocolError("frame rejected"))
                continue
            p = pending.pop(r.id, None)
            if p is None:
                continue  # a ping's reply, or a request already failed locally
            p._finish(r.result, r.error)
            if r.error is not None:
                self.unobserved.append(p)

    def fail_all(self, err: E.TransferError) -> None:
        self.broken = err
        pending, self.pending = self.pending, {}
        for p in pending.values():
            p._finish(None, err)

    def check_usable(self) -> None:
        if self.broken is not None:
            raise self.broken
        if os.getpid() != self.pid:
            raise E.SessionError("this client was created in another process (fork): connect again in this one")

    def take_unobserved(self) -> E.TransferError | None:
        """The first failure nobody asked about since the last call (fence reports it)."""
        failed, self.unobserved = self.unobserved, []
        errs = [p._error for p in failed if not p._observed and p._error is not None]
        if not errs:
            return None
        first = errs[0]
        if len(errs) > 1:
            first.add_note(f"{len(errs) - 1} more request(s) also failed since the last fence")
        return first


def _touched(cls: type[P.Request], args: tuple[Any, ...]) -> list[int]:
    """The VAs (one per segment is enough) a data request reads or writes."""
    if cls is P.Copy:
        return [args[0], args[1]]
    if cls in (P.Fill, P.Checksum, P.Share):
        return [args[0]]
    if cls is P.CopyV:
        both = np.concatenate([args[0], args[1]]) >> np.uint64(40)
        return [int(x) << 40 for x in np.unique(both).tolist()]
    if cls is P.Compute:
        return [t.va for t in (*args[1], *args[2])]
    return []
