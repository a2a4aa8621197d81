"""Deferred creation, client side: answer create/configure calls locally.

At hello the daemon grants the session an *arena* per device: a block of
segment ids (each id is a 1 TiB VA range) and a byte quota. `alloc` picks a
free id from that block and returns its VA at once; nothing is sent. The
allocation's definition (size, device, and where in the user's code it was
created) travels inside the first frame that touches its VA; frees travel
with the next frame. Tensor descriptors and operator plans work the same
way: created and changed here, defined on the daemon at first use, re-sent
with a new version when changed after use, never used stale. A remote
segment's registration takes an id of the home arena the same way
(`client._remote`).
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .. import _results as R
from .. import errors as E
from .. import protocol as P
from .._units import fmt_bytes
from ..addressing import OFFSET_BITS
from ..kernels import DTYPES, OPERATORS, GraphNode, GraphSpec, TensorRef, graph_wire, parse_graph, shape_tuple, tensor_extent
from ._resources import Addressed

__all__ = ["Arena", "DeferredBuffer", "Tensor", "Plan", "Graph", "DeferredState", "creation_site"]

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_OURS: dict[str, bool] = {}  # a code file -> whether it is this package's


def _ours(filename: str) -> bool:
    ours = _OURS.get(filename)
    if ours is None:
        ours = _OURS[filename] = os.path.abspath(filename).startswith(_PKG_DIR)
    return ours


def creation_site() -> str:
    """file:line of the first frame outside this package (where the user created the resource)."""
    f: FrameType | None = sys._getframe(1)
    while f is not None and _ours(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return "<unknown>"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


@dataclass
class Arena:
    """A block of `count` segment ids from `first_id`: ids never handed out are counted
    (`fresh`, the next one), ids given back are kept (`free_ids`, reused first), so an
    arena costs the same whatever its size."""

    device: int
    first_id: int
    count: int
    quota: int
    used: int = 0
    free_ids: list[int] = field(default_factory=list)
    fresh: int = 0

    def __post_init__(self) -> None:
        self.fresh = self.first_id

    def take(self) -> int | None:
        """An id of this arena not in use, or None when all are."""
        if self.free_ids:
            return self.free_ids.pop()
        if self.fresh < self.first_id + self.count:
            self.fresh += 1
            return self.fresh - 1
        return None


class DeferredBuffer(Addressed):
    """A device buffer whose VA exists before the daemon has allocated it."""

    def __init__(self, va: int, nbytes: int, device: int, site: str) -> None:
        self.va = va
        self.nbytes = nbytes
        self.device = device
        self.site = site
        self.defined = False  # the daemon has (been sent) its definition
        self.freed = False

    def define(self, new: Callable[..., P.Request]) -> P.Request:
        """Its definition, sent ahead of the first request that names it."""
        return new(P.Define, P.DEF_ALLOC, 0, 0, [self.va, self.nbytes, self.device], self.site)

    def __repr__(self) -> str:
        return f"<DeferredBuffer va={self.va:#x} nbytes={self.nbytes} device={self.device} {'defined' if self.defined else 'pending'}>"


_ids = itertools.count(1)


class Tensor:
    """A tensor descriptor with a client-side id: created and changed here, defined at first use."""

    ref: TensorRef  # the current description (set() makes each one)

    def __init__(self, owner: Any, shape: Sequence[int], dtype: Any, offset: int = 0, strides: Sequence[int] | None = None) -> None:
        self.id = next(_ids)
        self.version = 0
        self.sent_version = -1
        self.site = creation_site()
        self._owner = owner
        self.set(shape=shape, dtype=dtype, offset=offset, strides=strides)

    def set(self, *, shape: Sequence[int] | None = None, dtype: Any = None, offset: int | None = None, strides: Sequence[int] | None = None) -> "Tensor":
        """Change the description; a new version is sent with the next use."""
        shape = shape_tuple(shape if shape is not None else self.ref.shape)
        dt = np.dtype(dtype if dtype is not None else self.ref.dtype)
        if dt.name not in DTYPES:
            raise TypeError(f"dtype {dt} is not supported; use one of {', '.join(DTYPES)}")
        off = offset if offset is not None else (self.ref.va - self._owner.va)
        ref = TensorRef(self._owner.va + off, dt.name, shape, None if strides is None else tuple(int(s) for s in strides))
        if off < 0 or off + tensor_extent(ref) > self._owner.nbytes:
            raise E.OutOfBounds(f"tensor {shape} {dt} at offset {off} exceeds {self._owner.nbytes} bytes (created at {self.site})")
        self.ref = ref
        self.version += 1
        return self

    def definition(self) -> list[Any]:
        return self.ref.to_wire()

    def __repr__(self) -> str:
        return f"<Tensor #{self.id} v{self.version} {self.ref.shape} {self.ref.dtype}>"


class Plan:
    """An operator configuration (operator, parameters, placement) with a client-side id."""

    def __init__(self, op: str, params: dict[str, Any] | None = None, *, device: int = -1, placement: str = "") -> None:
        if op not in OPERATORS:
            raise E.UnknownOperation(f"unknown operator {op!r}; known: {', '.join(sorted(OPERATORS))}")
        self.id = next(_ids)
        self.version = 1
        self.sent_version = -1
        self.site = creation_site()
        self.op = op
        self.params = dict(params or {})
        self.device = device
        self.placement = placement

    def set(self, **params: Any) -> "Plan":
        """Change parameters; the next use re-sends the plan under a new version."""
        self.params.update(params)
        self.version += 1
        return self

    def definition(self) -> list[Any]:
        return [self.op, self.params, self.device, self.placement, self.site]

    def __repr__(self) -> str:
        return f"<Plan #{self.id} v{self.version} {self.op}>"


class Graph:
    """A computation graph: operators over named tensors, defined on the daemon at its first run.

    Declare the tensors (`input`, `output`, `tensor` for intermediates, `weight` for
    memory the graph reads at a fixed VA), then the operators in an order where each
    comes after the operators whose outputs it reads (`op`). The first run checks the
    graph here (`transfer.kernels.parse_graph`, the daemon's own check), takes an id
    for its memory from the session's arena, and sends the definition with the run;
    from then on a run carries only VAs. A graph is immutable once run.
    """

    def __init__(self, *, device: int = -1, placement: str = "") -> None:
        self.site = creation_site()
        self.device = device
        self.placement = placement
        self.version = 1
        self.sent_version = -1
        self._tensors: dict[str, tuple[str, tuple[int, ...], int | None]] = {}
        self._nodes: list[GraphNode] = []
        self._inputs: list[str] = []
        self._outputs: list[str] = []
        #: The checked graph and its memory (an arena id), from the first run on.
        self.spec: GraphSpec | None = None
        self.memory: DeferredBuffer | None = None

    @property
    def va(self) -> int:
        """The graph's handle on the wire (the VA of its memory); set by the first run."""
        if self.memory is None:
            raise E.InvalidField(f"the graph created at {self.site} has not been run yet")
        return self.memory.va

    def _declare(self, name: str, shape: Sequence[int], dtype: Any, va: int | None) -> str:
        if self.spec is not None:
            raise E.InvalidField(f"the graph created at {self.site} was already run: graphs are immutable, build a new one")
        if name in self._tensors:
            raise E.InvalidField(f"graph created at {self.site}: tensor {name!r} is declared twice")
        dt = np.dtype(dtype)
        if dt.name not in DTYPES:
            raise TypeError(f"dtype {dt} is not supported; use one of {', '.join(DTYPES)}")
        self._tensors[name] = (dt.name, tuple(int(d) for d in shape), va)
        return name

    def input(self, name: str, shape: Sequence[int], dtype: Any) -> str:
        """A tensor each run binds to a VA (contiguous)."""
        self._inputs.append(name)
        return self._declare(name, shape, dtype, None)

    def output(self, name: str, shape: Sequence[int], dtype: Any) -> str:
        """A tensor each run writes at a VA it binds (contiguous)."""
        self._outputs.append(name)
        return self._declare(name, shape, dtype, None)

    def tensor(self, name: str, shape: Sequence[int], dtype: Any) -> str:
        """An intermediate: lives in the daemon's memory for this graph, never addressed here."""
        return self._declare(name, shape, dtype, None)

    def weight(self, name: str, ref: "TensorRef | Tensor") -> str:
        """A tensor at a fixed VA (a device buffer's `tensor(...)`, or a `Tensor` descriptor)."""
        r = ref.ref if isinstance(ref, Tensor) else ref
        if r.strides is not None:
            raise E.InvalidField(f"graph created at {self.site}: weight {name!r} must be contiguous")
        return self._declare(name, r.shape, r.dtype, r.va)

    def op(self, op: str, inputs: Sequence[str], outputs: Sequence[str] | str, params: dict[str, Any] | None = None,
           *, device: int = -1, placement: str = "") -> None:
        """Append an operator reading `inputs` and writing `outputs` (names); `device` and
        `placement` override the graph's for this operator."""
        if self.spec is not None:
            raise E.InvalidField(f"the graph created at {self.site} was already run: graphs are immutable, build a new one")
        outs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
        self._nodes.append(GraphNode(op, tuple(inputs), outs, dict(params or {}), device, placement))

    def definition(self) -> list[Any]:
        return graph_wire([(n, dt, shape, va) for n, (dt, shape, va) in self._tensors.items()],
                          self._nodes, self._inputs, self._outputs, self.device, self.placement)

    def weight_vas(self) -> list[int]:
        return [va for _, _, va in self._tensors.values() if va is not None]

    def prepare(self, state: "DeferredState") -> None:
        """Check the graph (once) and take its memory's id from the arena."""
        if self.memory is not None:
            if self.memory.freed:
                raise E.SegmentFreed(f"the graph created at {self.site} was freed")
            return
        spec = parse_graph(self.definition(), f"graph created at {self.site}")
        self.memory = state.reserve(spec.scratch_nbytes, self.device, self.site)
        self.spec = spec

    def __repr__(self) -> str:
        return f"<Graph {len(self._nodes)} ops {self._inputs} -> {self._outputs} {'defined' if self.spec else 'pending'}>"


class DeferredState:
    """Arenas, pending definitions and frees: what the next frame must carry first.

    `buffers` holds what the daemon has not been sent yet, by segment id: device buffers,
    and anything else with `defined`, `freed` and `define(new)` (a remote segment's
    registration, `client._remote`)."""

    def __init__(self, arenas: Iterable[R.Arena], home_device: int = -1,
                 after: dict[int, Callable[[Any], None]] | None = None) -> None:
        self.arenas = {a.device: Arena(a.device, a.first_id, a.count, a.quota) for a in arenas}
        #: The session's home device (hello): device -1 means its arena, as eager alloc means it.
        self.home_device = home_device
        self.buffers: dict[int, DeferredBuffer] = {}  # segment id -> buffer not yet defined
        self.frees: list[int] = []
        #: What to do once the daemon has answered a free, by VA (`free_remote`); filed into
        #: `after` (the client's `ClientCore.after`) by request id when the free is sent.
        self.when_freed: dict[int, Callable[[Any], None]] = {}
        self.after = after if after is not None else {}

    def alloc(self, nbytes: int, device: int, site: str) -> DeferredBuffer:
        if not self.arenas:
            raise E.SessionError("the daemon granted no arena (deferred allocation unavailable)")
        if device == -1:
            device = self.home_device
        arena = self.arenas.get(device)
        if arena is None:
            raise E.InvalidField(f"alloc at {site}: device {device} does not exist (arenas: {sorted(self.arenas)})")
        if nbytes <= 0 or nbytes > (1 << OFFSET_BITS):
            raise E.InvalidField(f"alloc of {nbytes} bytes at {site}: size must be in 1..{1 << OFFSET_BITS}")
        if arena.quota and arena.used + nbytes > arena.quota:
            raise E.QuotaExceeded(
                f"alloc of {fmt_bytes(nbytes)} created at {site} exceeds the device memory this session may hold, "
                f"{fmt_bytes(arena.quota)} ({fmt_bytes(arena.used)} in use): the daemon's --max-device-bytes-per-session, "
                f"or its whole --max-device-bytes where that is unlimited"
            )
        sid = arena.take()
        if sid is None:
            raise E.QuotaExceeded(
                f"alloc at {site}: this session already holds {arena.count} device buffers on device {device}, the most "
                f"one session may (the daemon's --arena-ids). Free buffers you no longer need (client.free), "
                "allocate one larger buffer and address parts of it (buf.va + offset), or ask the operator "
                "to raise --arena-ids"
            )
        arena.used += nbytes
        buf = DeferredBuffer(sid << OFFSET_BITS, nbytes, device, site)
        self.buffers[sid] = buf
        return buf

    def name(self, entry: Any, site: str) -> int:
        """A VA of the home arena for `entry`, which the daemon makes itself from
        `entry.define(new)` (a remote segment's registration): sent ahead of the first request
        naming it. It takes an id, not bytes, of the arena; `forget` gives the id back."""
        arena = self._home_arena()
        if arena is None:
            raise E.SessionError("the daemon granted no arena (deferred registration unavailable)")
        sid = arena.take()
        if sid is None:
            raise E.QuotaExceeded(
                f"registration at {site}: this session already names {arena.count} "
                "buffers and segments from its arena, the most one session may (the daemon's --arena-ids). "
                "Free what you no longer need (client.free), or ask the operator to raise --arena-ids"
            )
        self.buffers[sid] = entry
        return sid << OFFSET_BITS

    def forget(self, va: int) -> None:
        """An id `name` gave out is free again (the daemon never had it, or has let it go)."""
        sid = va >> OFFSET_BITS
        self.buffers.pop(sid, None)
        arena = self._home_arena()
        assert arena is not None  # (`name` gave the id out of it)
        arena.free_ids.append(sid)

    def _home_arena(self) -> Arena | None:
        """Where `name` takes ids: the home device's arena (any, where it has none)."""
        return self.arenas.get(self.home_device) or next(iter(self.arenas.values()), None)

    def reserve(self, nbytes: int, device: int, site: str) -> DeferredBuffer:
        """An arena id and bytes for memory the daemon fills in itself (a graph's): no alloc
        definition travels for it; the graph's definition allocates it."""
        buf = self.alloc(nbytes, device, site)
        del self.buffers[buf.va >> OFFSET_BITS]
        buf.defined = True
        return buf

    def free(self, buf: DeferredBuffer) -> None:
        if buf.freed:
            raise E.SegmentFreed(f"buffer created at {buf.site} was already freed")
        buf.freed = True
        sid = buf.va >> OFFSET_BITS
        if not buf.defined:
            # Never reached the daemon: nothing to tell it.
            self.buffers.pop(sid, None)
            self._recycle(buf)
            return
        self.frees.append(buf.va)
        self._recycle(buf)

    def free_remote(self, va: int, then: Callable[[Any], None]) -> None:
        """A remote segment the daemon has mapped, freed: the free travels with the next frame
        (its id is the arena's again at once: the free goes ahead of any reuse), and `then`
        runs when its answer is read (the memory may be deregistered then, not before)."""
        self.frees.append(va)  # (the same list: the submission state watches it)
        self.when_freed[va] = then
        self.forget(va)

    def _recycle(self, buf: DeferredBuffer) -> None:
        arena = self.arenas[buf.device]
        arena.used -= buf.nbytes
        arena.free_ids.append(buf.va >> OFFSET_BITS)

    def definitions_for(self, vas: Iterable[int], objects: Iterable[Any], new: Any) -> list[P.Request]:
        """Define requests that must precede a request touching `vas` and using `objects`."""
        out: list[P.Request] = []
        if self.frees:
            for va in self.frees:
                req = new(P.Define, P.DEF_FREE, 0, 0, va, "")
                then = self.when_freed.pop(va, None)
                if then is not None:
                    self.after[req.id] = then
                out.append(req)
            self.frees.clear()  # (the same list: the submission state watches it)
        for va in vas:
            buf = self.buffers.get(va >> OFFSET_BITS)
            if buf is None:
                continue
            if not buf.defined and not buf.freed:
                out.append(buf.define(new))  # (first: a definition that cannot be made stays pending)
                buf.defined = True
            del self.buffers[va >> OFFSET_BITS]
        for obj in objects:
            if isinstance(obj, Graph) and obj.sent_version != obj.version:
                out.extend(self.definitions_for(obj.weight_vas(), (), new))  # weights before the graph reads them
                out.append(new(P.Define, P.DEF_GRAPH, obj.va, obj.version, obj.definition(), obj.site))
                obj.sent_version = obj.version
                continue
            if obj.sent_version != obj.version:
                if isinstance(obj, Tensor):
                    for d in self.definitions_for([obj.ref.va], (), new):
                        out.append(d)
                kind = P.DEF_TENSOR if isinstance(obj, Tensor) else P.DEF_PLAN
                out.append(new(P.Define, kind, obj.id, obj.version, obj.definition(), obj.site))
                obj.sent_version = obj.version
        return out


