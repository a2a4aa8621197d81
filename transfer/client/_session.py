"""The public client API, written once for both clients.

A method that has to wait for the daemon is an *operation*: a generator that
yields each `Pending` it needs and resumes when that request is done (the
result is read from it; a failed wait is thrown in, so cleanup code runs).
Each client supplies the driver, `_run`: the blocking client runs the
operation to its end in the caller's thread and returns the value; the trio
client returns a coroutine that does the same with `await`. So
`c.segment(n)` and `await c.segment(n)` are one implementation. Submitting a
data request (`copy`, `fill`, `checksum`, `copy_many`, `compute`) never waits
on either client: it returns a pending request at once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import Any, Callable, Generator, Sequence, TypeVar

import numpy as np

from .. import _results as R
from .. import errors as E
from .. import protocol as P
from ..addressing import OFFSET_BITS
from ..memory import ShmFile
from ._computes import ComputeGraphs
from ._core import ClientCore
from ._deferred import DeferredBuffer, Graph, Plan, Tensor, creation_site
from .._pending import Pending
from ._pool import SlotPool
from ._socket import connect_channel
from ._remote import RemoteAgent, RemoteSegment, register as register_remote
from ._resources import Addressable, DeviceBuffer, HostSegment, SharedSegment, resolve_va
from ..ring import RingLink
from ..transport._zmq import ipc_path

log = logging.getLogger("transfer.client")

#: Descriptors in a session's ring (default, or `ring=True`).
RING_CAPACITY = 1024
#: What a vector request's arrays are (NumPy's one uint64 dtype object).
_U64 = np.dtype(np.uint64)

__all__ = ["Session", "Op", "operation"]

T = TypeVar("T")
#: An operation: yields the requests it waits on, returns its value.
Op = Generator[Pending, None, T]


def operation(fn: Callable[..., Op[Any]]) -> Callable[..., Any]:
    """The public method for an operation `_op_NAME`: `self._run(self._op_NAME(...))`."""

    @functools.wraps(fn)
    def run(self: "Session", *args: Any, **kwargs: Any) -> Any:
        return self._run(fn(self, *args, **kwargs))

    run.__name__ = fn.__name__.removeprefix("_op_")
    run.__qualname__ = fn.__qualname__.replace(fn.__name__, run.__name__)
    return run


class Session:
    """What `Client` and `TrioClient` share: the whole API over one `ClientCore`."""

    def __init__(self, endpoint: str, pending_cls: type[Pending], waiter: Callable[..., Any]) -> None:
        self.endpoint = endpoint
        self._core = ClientCore(pending_cls, waiter)
        self._batch: list[P.Request] | None = None
        #: Held while touching shared state: the blocking client is thread-safe. A loop
        #: client runs in one thread and never contends; an uncontended RLock costs less to
        #: take than a Python-level null context manager, and submission takes it every call.
        self._lock = threading.RLock()
        self._core.sub.guard(self._lock)  # (the native submit takes it too)
        self._computes = ComputeGraphs()

    @property
    def frames_sent(self) -> int:
        """Frames (zmq messages) this client has sent: what deferred creation saves."""
        return self._core.sub.frames

    # --- what each client supplies ----------------------------------------------------------
    def _run(self, op: Op[T], timeout: float | None = None) -> Any:
        """Drive an operation: its value (blocking) or an awaitable of it (trio)."""
        raise NotImplementedError

    def _send(self, reqs: Sequence[P.Request]) -> None:
        """Hand requests to the ring or the socket (never waits in trio; may in the blocking client)."""
        raise NotImplementedError

    #: Whether this client waits for ring completions on a doorbell fd (trio) rather than
    #: the ring's futex (the blocking client): the daemon makes one only when asked.
    _completion_bell = False

    def _link(self, info: R.RingOpened | R.ChannelOpened) -> RingLink:
        """The session's ring, with what this client needs to wait on it (`_map`)."""
        raise NotImplementedError

    def _map(self, info: R.RingOpened | R.ChannelOpened) -> RingLink:
        """Map the ring the daemon made (same host), or make ours and connect its data
        channel (another host)."""
        bell = self._completion_bell
        if isinstance(info, R.ChannelOpened):
            sock = connect_channel(self.endpoint, info.port, self.session_id, info.key)
            return RingLink.remote(info, sock, self._core.sub, completion_bell=bell)
        return RingLink.open(info, self._core.collect, self._core.sub, completion_bell=bell)

    # --- session facts -------------------------------------------------------------------
    @property
    def session_id(self) -> int:
        return self._core.session_id

    @property
    def server_pid(self) -> int:
        return self._core.server_pid

    @property
    def backend(self) -> str:
        """The daemon's device backend: "cupy", "numpy" (or "streamsim", in tests)."""
        return str(self._core.backend.get("backend", ""))

    @property
    def backend_info(self) -> dict[str, Any]:
        """What the daemon said of its backend at hello: its name, devices, GPUs' names."""
        return dict(self._core.backend)

    @property
    def home_device(self) -> int:
        """The daemon device this session's `alloc()` uses when no device is named (chosen at hello)."""
        return self._core.home_device

    @property
    def ring(self) -> bool:
        """Whether data requests take the shared-memory ring."""
        return self._core.ring is not None

    @property
    def _ring(self) -> RingLink | None:
        return self._core.ring

    @property
    def _remote(self) -> RemoteAgent | None:
        return self._core.remote

    # --- the handshake, the ring, the end ---------------------------------------------------
    def _op_hello(self, name: str, deferred: bool, priority: str = "normal") -> Op[None]:
        if priority not in P.PRIORITIES:
            raise ValueError(f"priority {priority!r}: choose from {', '.join(P.PRIORITIES)}")
        info = yield from self._op_call(P.Hello, P.VERSION, name or f"pid{os.getpid()}", os.getpid(), b"", P.PRIORITIES[priority])
        self._core.on_hello(info, deferred)

    def _op_open_ring(self, capacity: int) -> Op[None]:
        """The same-host ring (ipc), or on tcp the ring carried over a data channel."""
        if ipc_path(self.endpoint) is None:
            info = yield from self._op_call(P.OpenChannel, capacity)
        else:
            info = yield from self._op_call(P.OpenRing, capacity, self._completion_bell)
        self._core.ring = self._link(info)

    _open_ring = operation(_op_open_ring)

    def _op_start_ring(self, ring: bool | int | None) -> Op[None]:
        """The ring, unless opted out (`ring=False`): by default every session gets one (a
        same-host one shares the daemon's; on tcp, a data channel carries it); where the
        daemon cannot give one (no shared memory left, a ring quota, no channel port) the
        session stays on the socket, which carries everything too. An explicit `ring` raises."""
        if ring is False or (ring is not None and ring is not True and int(ring) <= 0):
            return
        if ring is None:
            try:
                yield from self._op_open_ring(RING_CAPACITY)
            except (E.RingUnavailable, E.ResourceError, E.UnknownOperation) as exc:
                log.info("no ring for this session (%s): requests go over the socket", exc)
            return
        yield from self._op_open_ring(RING_CAPACITY if ring is True else int(ring))

    _start_ring = operation(_op_start_ring)

    def _op_close(self) -> Op[None]:
        """Tell the daemon (it releases everything the session holds), unless it is gone."""
        link = self._core.ring
        if link is not None and self._core.broken is None and link.ring.peer_closed:
            self._core.ring_closed()  # its end of the ring (or the data channel) closed: nobody to tell
        if self._core.broken is None and os.getpid() == self._core.pid:
            yield from self._op_call(P.Close)

    # --- resources -------------------------------------------------------------------------
    def _op_segment(self, nbytes: int) -> Op[HostSegment]:
        """Shared memory of `nbytes`, mapped here and in the daemon."""
        info = yield from self._op_call(P.RegisterHost, nbytes)
        try:
            shm = ShmFile.attach(self._core.collect(info.token), info.nbytes)
        except BaseException:
            # The daemon holds a segment we could not map: hand it back, then fail.
            with contextlib.suppress(E.TransferError):
                yield from self._op_call(P.Unregister, info.va)
            raise
        seg = HostSegment(self, info.va, info.nbytes, shm)
        self._core.segments[seg.va] = seg
        return seg

    segment = operation(_op_segment)

    def _op_alloc(self, nbytes: int, device: int = -1) -> Op[DeviceBuffer | DeferredBuffer]:
        """A zeroed buffer on one of the daemon's devices.

        Deferred (the default): the VA comes from this session's arena at once, and
        the daemon allocates when the first request touching it arrives; an error
        then names the line that called alloc.
        """
        state = self._core.deferred
        if state is not None:
            with self._lock:
                return state.alloc(nbytes, device, creation_site())
        info = yield from self._op_call(P.Alloc, nbytes, device)
        return DeviceBuffer(self, info.va, info.nbytes, info.device)

    alloc = operation(_op_alloc)

    def _op_free(self, resource: Any) -> Op[None]:
        """Release a segment or buffer (waits for the daemon, so its VA is dead afterwards)."""
        core = self._core
        if isinstance(resource, HostSegment):
            yield from self._op_call(P.Unregister, resource.va)
            core.segments.pop(resource.va, None)
            resource._unmap()
        elif isinstance(resource, DeviceBuffer):
            yield from self._op_call(P.Free, resource.va)
        elif isinstance(resource, DeferredBuffer):
            assert core.deferred is not None
            with self._lock:
                core.deferred.free(resource)  # travels with the next frame
        elif isinstance(resource, Graph):
            if resource.memory is not None and core.deferred is not None:
                with self._lock:
                    core.deferred.free(resource.memory)  # its intermediates go with the next frame
        elif isinstance(resource, RemoteSegment):
            shared = resource._shared
            if resource._release():  # (the last handle of its memory: the daemon lets go first, then we deregister)
                resource._detach()
                yield from self._op_free_remote(shared)
        else:
            raise TypeError(f"cannot free {type(resource).__name__}")

    free = operation(_op_free)

    def _op_free_remote(self, shared: Any) -> Op[None]:
        """The daemon lets go of a registration's segment, then we deregister the memory (and a
        deferred one's arena id is free again). A deferred registration's free travels with
        the next frame, as a deferred buffer's does, and its answer deregisters
        (`ClientCore.after`); a registration never sent is deregistered at once."""
        core, agent = self._core, self._core.remote
        assert agent is not None
        state = core.deferred

        def gone(p: Pending | None = None) -> None:
            agent.leaving.pop(shared.key, None)
            agent.let_go(shared)
            core.remote_sids.discard(shared.va >> OFFSET_BITS)

        with self._lock:
            shared.freed = True
            if shared.deferred and state is not None:
                if shared.defined:
                    agent.leaving[shared.key] = shared
                    state.free_remote(shared.va, gone)
                else:
                    state.forget(shared.va)
                    gone()
                return
        yield from self._op_call(P.Unregister, shared.va)  # (eager: as its registration was)
        gone()

    def _op_register_remote(self, array: np.ndarray) -> Op[RemoteSegment]:
        """Register `array` (this process's memory) with NIXL and map it in the daemon as a
        remote segment: copies from its VAs are one-sided READs, copies to it WRITEs."""
        with self._lock:
            if self._core.remote is None:
                self._core.remote = RemoteAgent(self._core.session_id)
            agent = self._core.remote
            state = self._core.deferred
        seg = yield from register_remote(self, agent, array, self._op_call, state, self._lock)
        with self._lock:  # its requests take the socket: the daemon posts NIXL for them on its loop
            self._core.remote_sids.add(seg.va >> OFFSET_BITS)
        return seg

    register_remote = operation(_op_register_remote)

    def _op_remote_segment(self, nbytes: int) -> Op[RemoteSegment]:
        """A new zeroed buffer of `nbytes` here, registered as a remote segment."""
        return (yield from self._op_register_remote(np.zeros(nbytes, dtype=np.uint8)))

    remote_segment = operation(_op_remote_segment)

    def _op_pool(self, slot_nbytes: int, slots: int = 4) -> Op[SlotPool]:
        """Batch slots over one segment: acquire, write, submit; a slot returns once the daemon is done."""
        stride = SlotPool.stride(slot_nbytes, slots)
        seg = yield from self._op_segment(stride * slots)
        return SlotPool(self, seg, slot_nbytes, slots, stride)

    pool = operation(_op_pool)

    def _op_share(self, resource: HostSegment | DeviceBuffer) -> Op[bytes]:
        """A token that lets another session name this segment's VAs (fan-in to one consumer)."""
        shared = yield from self._op_call(P.Share, resource.va)
        return bytes(shared.token)

    share = operation(_op_share)

    def _op_attach(self, token: bytes) -> Op[SharedSegment]:
        """Use a segment another session shared; valid until its owner frees it."""
        info = yield from self._op_call(P.Attach, token)
        return SharedSegment(info.va, info.nbytes, info.kind, info.device)

    attach = operation(_op_attach)

    def _op_tensor(self, owner: Any, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0, strides: Sequence[int] | None = None) -> Op[Tensor]:
        """A tensor descriptor over a buffer or segment: defined on the daemon at first use."""
        t = Tensor(owner, (shape,) if isinstance(shape, int) else shape, dtype, offset, strides)
        if self._core.deferred is None:
            yield from self._op_define(t)
        return t

    tensor = operation(_op_tensor)

    def _op_plan(self, op: str, params: dict[str, Any] | None = None, *, device: int = -1, placement: str = "") -> Op[Plan]:
        """An operator configuration, reusable across compute calls; defined at first use."""
        p = Plan(op, params, device=device, placement=placement)
        if self._core.deferred is None:
            yield from self._op_define(p)
        return p

    plan = operation(_op_plan)

    def _op_define(self, obj: Tensor | Plan) -> Op[None]:
        """Eager mode (deferred=False): define a descriptor now."""
        kind = P.DEF_TENSOR if isinstance(obj, Tensor) else P.DEF_PLAN
        yield from self._op_call(P.Define, kind, obj.id, obj.version, obj.definition(), obj.site)
        obj.sent_version = obj.version

    # --- waiting on the session -------------------------------------------------------------
    def fence(self, stream: int = 0, timeout: float | None = None) -> Any:
        """Wait until everything submitted on `stream` is done; raise the first unobserved failure."""
        return self._run(self._op_fence(stream), timeout)

    def _op_fence(self, stream: int) -> Op[None]:
        fence = self._submit(P.Fence, stream, blocking=True)
        yield fence
        fence.result()
        # What came before it is done; an answer that travels the other way may still be
        # coming (a socket reply when the fence took the ring, a ring failure's message).
        for p in self._core.answers_before(fence.id):
            yield p
        err = self._core.take_unobserved()
        if err is not None:
            raise err

    def _op_stats(self) -> Op[dict[str, Any]]:
        """The daemon's counters, and this session's."""
        stats: dict[str, Any] = yield from self._op_call(P.Stats)
        return stats

    stats = operation(_op_stats)

    # --- data requests (return a pending request at once) -------------------------------------
    def batch(self) -> "_Batch":
        """Requests submitted inside the block leave in one frame (or one ring push) when it exits."""
        return _Batch(self)

    def copy(self, dst: Addressable, src: Addressable, nbytes: int | None = None, *, stream: int = 0) -> Any:
        """Copy `nbytes` from `src` to `dst` inside the daemon (VAs or segments/buffers)."""
        if nbytes is None:
            sizes = [getattr(x, "nbytes") for x in (dst, src) if hasattr(x, "nbytes")]
            if not sizes:
                raise TypeError("nbytes is required when copying between plain VAs")
            nbytes = min(sizes)
        args = (dst if type(dst) is int else resolve_va(dst), src if type(src) is int else resolve_va(src), nbytes, stream)
        return self._core.submit(P.Copy, args) or self._submit(P.Copy, *args)  # (one native call, most copies)

    def copy_many(self, dst: Sequence[int] | np.ndarray, src: Sequence[int] | np.ndarray, nbytes: Sequence[int] | np.ndarray, *,
                  stream: int = 0, checksum: bool = False) -> Any:
        """Many copies as one vector request; the daemon merges contiguous ones.

        `checksum=True`: a verified copy. The result is a uint64 array of each piece's
        checksum64 as copied (what its destination holds after it), in order: one request
        that reads the bytes once, where a copy then a `checksum_many` reads them twice."""
        # (A group's hot path: arrays that are uint64 already are taken as they are.)
        d = dst if type(dst) is np.ndarray and dst.dtype is _U64 else np.asarray(dst, _U64)
        s = src if type(src) is np.ndarray and src.dtype is _U64 else np.asarray(src, _U64)
        n = nbytes if type(nbytes) is np.ndarray and nbytes.dtype is _U64 else np.asarray(nbytes, _U64)
        if not (d.ndim == s.ndim == n.ndim == 1 and len(d) == len(s) == len(n)):
            raise ValueError("copy_many needs three 1-D sequences of equal length")
        if checksum and not len(n):
            raise ValueError("copy_many(checksum=True) needs at least one range")
        args = (d, s, n, stream, True) if checksum else (d, s, n, stream)
        return self._core.submit(P.CopyV, args) or self._submit(P.CopyV, *args)  # (one native call, most groups)

    def fill(self, dst: Addressable, nbytes: int, value: int = 0, *, stream: int = 0) -> Any:
        """Set `nbytes` at `dst` to the byte `value`."""
        args = (resolve_va(dst), nbytes, value, stream)
        return self._core.submit(P.Fill, args) or self._submit(P.Fill, *args)

    def checksum(self, src: Addressable, nbytes: int | None = None, *, stream: int = 0) -> Any:
        """The daemon reads the range in place and answers its checksum64."""
        if nbytes is None:
            nbytes = int(getattr(src, "nbytes"))
        args = (resolve_va(src), nbytes, stream)
        return self._core.submit(P.Checksum, args) or self._submit(P.Checksum, *args)

    def checksum_many(self, srcs: Sequence[int] | np.ndarray, nbytes: Sequence[int] | np.ndarray, *, stream: int = 0) -> Any:
        """checksum64 of many ranges as one vector request: a Pending whose result is a uint64
        array, in order (a batch's items verified for a fraction of a `checksum` call each).
        The ranges live on one device, as a `copy_many`'s do."""
        s, n = np.asarray(srcs, np.uint64), np.asarray(nbytes, np.uint64)
        if not (s.ndim == n.ndim == 1 and len(s) == len(n)):
            raise ValueError("checksum_many needs two 1-D sequences of equal length")
        if not len(s):
            raise ValueError("checksum_many needs at least one range")
        args = (s, n, stream)
        return self._core.submit(P.ChecksumV, args) or self._submit(P.ChecksumV, *args)

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
        in which case only their ids travel once the daemon has their definitions. A
        compute repeated with the same operator, parameters, dtypes and shapes runs as a
        one-node graph from its second call (`client._computes`): one ring descriptor, run
        by the session's ring worker where the daemon can.
        """
        if isinstance(op, Plan):
            if params:
                raise TypeError("a Plan carries its own parameters: use plan.set(...)")
            objs = [op, *inputs, *outputs]
            if not all(isinstance(t, Tensor) for t in objs[1:]):
                raise TypeError("compute with a Plan takes Tensor descriptors (client.tensor(...))")

            def ref(o: Tensor | Plan) -> tuple[int, int]:
                return o.id, o.version

            return self._submit(P.ComputeRef, [ref(op)], [ref(t) for t in inputs], [ref(t) for t in outputs], stream, objects=objs)
        ins = [t.ref if isinstance(t, Tensor) else t for t in inputs]
        outs = [t.ref if isinstance(t, Tensor) else t for t in outputs]
        params = dict(params or {})
        with self._lock:  # (a repeated compute runs as a one-node graph: `_computes`)
            graph = self._computes.graph(self._core.deferred, op, ins, outs, params, device, placement)
        if graph is not None:
            return self.run_graph(graph, [t.va for t in ins], [t.va for t in outs], stream=stream)
        return self._submit(P.Compute, op, ins, outs, params, device, placement, stream)

    def graph(self, *, device: int = -1, placement: str = "") -> Graph:
        """A computation graph to build, then run with `run_graph` (defined at its first run).

        `device` pins where its operators run and its intermediates live (default: the
        session's home device); `placement` names the policy for operators whose
        operands are all host memory (default: the daemon's `--placement`)."""
        if self._core.deferred is None:
            raise E.SessionError("graphs need deferred creation (the default; this client has deferred=False)")
        return Graph(device=device, placement=placement)

    def run_graph(self, graph: Graph, inputs: Sequence[Addressable], outputs: Sequence[Addressable], *,
                  profile: bool = False, stream: int = 0) -> Any:
        """Run the whole graph on inputs and outputs bound by VA (one request).

        The pending result is None, or with `profile` a dict whose "nodes" list gives
        each operator's device, kernel signature and time in microseconds."""
        ins, outs = [resolve_va(x) for x in inputs], [resolve_va(x) for x in outputs]
        state = self._core.deferred
        if state is None:
            raise E.SessionError("graphs need deferred creation (this client has deferred=False)")
        with self._lock:
            graph.prepare(state)
        return self._submit(P.RunGraph, graph.va, ins, outs, profile, stream, objects=[graph])

    # --- machinery ----------------------------------------------------------------------------
    def _submit(self, cls: type[P.Request], *args: Any, objects: Sequence[Any] = (), blocking: bool = False) -> Any:
        """Prepare one call's requests and send them (or hold them in a batch); never waits
        unless the daemon's credits are used up (blocking client only). The general path:
        `copy`, `fill` and `checksum` ask the submission state's native `submit` first,
        which takes a plain request to the ring in one call when nothing else is due."""
        lock = self._lock
        lock.acquire()  # (not `with`: the statement costs twice the two calls, on every request)
        try:
            reqs, pending = self._core.prepare(cls, args, objects, blocking)
            if self._batch is not None:
                self._batch.extend(reqs)
            else:
                self._send(reqs)
            return pending
        finally:
            lock.release()

    def _op_call(self, cls: type[P.Request], *args: Any) -> Op[Any]:
        """One request the caller waits on: its frame carries a Wait marker (a counted round trip).
        Its result comes back checked against the type the protocol declares for it (`on_frame`)."""
        p = self._submit(cls, *args, blocking=True)
        yield p
        return p.result()

    def _call(self, cls: type[P.Request], *args: Any, timeout: float | None = None) -> Any:
        return self._run(self._op_call(cls, *args), timeout)


class _Batch:
    """`Session.batch()`'s block: a class rather than a generator context manager, as it is
    entered once per group on a producer's hot path. Nested blocks join the outermost."""

    __slots__ = ("_session", "_outer")

    def __init__(self, session: Session) -> None:
        self._session = session

    def __enter__(self) -> None:
        s = self._session
        s._lock.acquire()
        self._outer = s._batch
        if s._batch is None:
            s._batch = []
            s._core.sub.batching = True  # (submit leaves requests to the batch)

    def __exit__(self, *exc: object) -> None:
        s = self._session
        try:
            if self._outer is None:
                reqs, s._batch = s._batch or [], None
                s._core.sub.batching = False
                if reqs and s._core.broken is None:  # (a failed session failed them already)
                    s._send(reqs)
        finally:
            s._lock.release()
