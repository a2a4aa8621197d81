"""Deferred creation, daemon side: arenas, definitions, cached descriptors.

The client allocates VAs from arenas granted at hello and sends each
definition (alloc, free, tensor, plan) inside the first frame that uses
it. Definitions are control requests: a pass runs them before the data
requests that follow them in the frame. Arenas are granted by `_resources`. Errors name the resource and the
place in the client's code where it was created.
"""

from __future__ import annotations

from typing import Any

from .. import _fields as F
from .. import _results as R
from .. import errors as E
from .. import protocol as P
from .._units import fmt_bytes
from ..addressing import OFFSET_BITS, SegmentKind
from ..kernels import OPERATORS, REGISTRY, TensorRef, parse_graph, signature, tensor_extent
from ._graphplan import GraphPlan
from ._resources import Resources
from ._session import Session

__all__ = ["define", "resolve", "define_graph"]




def define(resources: Resources, session: Session, req: P.Define) -> Any:
    session.stats.defines += 1
    where = f" created at {req.site}" if req.site else ""
    d = req.definition
    if req.kind == P.DEF_ALLOC:
        if type(d) is not list or len(d) != 3 or not all(type(x) is int for x in d):
            raise E.InvalidField("alloc definition is [va, nbytes, device]")
        va, nbytes, device = d
        return _alloc(resources, session, va, nbytes, device, "alloc", where)
    if req.kind == P.DEF_FREE:
        if type(d) is not int or not 0 <= d < 1 << 64:
            raise E.InvalidField("free definition is the buffer's or remote segment's VA")
        if resources.table.get(d >> OFFSET_BITS) is None:
            # An id of this session's arena that nothing holds: a definition this daemon refused
            # (its first use had that error). Freeing it frees nothing; any other VA is refused.
            resources.arena_slot(session, d, f"deferred free of {d:#x}")
            return None
        seg = resources.table.lookup(d, session.id)
        if d != seg.va or seg.kind not in (SegmentKind.DEVICE, SegmentKind.REMOTE):
            raise E.InvalidAddress(f"deferred free of {d:#x}: not a device buffer's or remote segment's base VA")
        resources.free(session, d, seg.kind)
        return None
    if req.kind == P.DEF_TENSOR:
        (t,) = F.tensors([d], f"tensor #{req.obj}{where}")
        session.defs[("tensor", req.obj)] = (req.version, t, req.site)
        return None
    if req.kind == P.DEF_PLAN:
        if type(d) is not list or len(d) != 5:
            raise E.InvalidField(f"plan #{req.obj}{where}: definition is [op, params, device, placement, site]")
        op, params, device, placement, _site = d
        if type(op) is not str or op not in OPERATORS:
            raise E.UnknownOperation(f"plan #{req.obj}{where}: unknown operator {op!r}")
        F.params(params, f"plan #{req.obj}.params")
        F.i32(device, f"plan #{req.obj}.device")
        F.text(32)(placement, f"plan #{req.obj}.placement")
        session.defs[("plan", req.obj)] = (req.version, (op, params, device, placement), req.site)
        return None
    if req.kind == P.DEF_GRAPH:
        return define_graph(resources, session, req.obj, d, req.site)
    raise E.InvalidField(f"unknown definition kind {req.kind}")


def _alloc(resources: Resources, session: Session, va: int, nbytes: int, device: int, what: str, where: str) -> R.Allocated:
    """Materialize an arena allocation at `va` (a buffer's, or a graph's memory)."""
    sid, arena_dev = resources.arena_slot(session, va, f"{what}{where}")
    if device not in (-1, arena_dev):
        raise E.InvalidField(f"{what}{where}: VA {va:#x} belongs to the arena of device {arena_dev}, not {device}")
    try:
        return resources.alloc_at(session, sid, nbytes, arena_dev)
    except E.TransferError as exc:
        raise type(exc)(f"{what} of {fmt_bytes(nbytes)}{where}: {exc.message}") from None


def define_graph(resources: Resources, session: Session, va: int, d: Any, site: str) -> None:
    """A graph (Define kind 5, `obj` = the graph's VA in an arena): checked whole, then its
    intermediates allocated as one device segment at that VA, which carries the graph.

    Everything from the wire is checked before memory is taken: structure, names and
    cycles, every node's shapes, dtypes and parameters (`parse_graph`), that the graph's
    device has a kernel for every node that touches its intermediates, and that every
    weight is memory this session may read. The allocation is the session's like any
    other (quota, freed with the graph's VA or with the session).
    """
    where = f" created at {site}" if site else ""
    what = f"graph {va:#x}{where}"
    spec = parse_graph(d, what)
    for i, node in enumerate(spec.nodes):
        F.params(node.params, f"{what}, node {i} ({node.op}).params")
    ndev = len(resources.devices)
    for i, node in enumerate(spec.nodes):
        pinned = node.device if node.device != -1 else spec.device
        if pinned != -1 and pinned >= ndev:
            raise E.InvalidField(f"{what}, node {i} ({node.op}): device {pinned} does not exist (this daemon has {ndev})")
    for name, t in spec.tensors.items():
        if t.va:
            try:
                resources.table.translate(t.va, tensor_extent(t), session.id)
            except E.TransferError as exc:
                raise type(exc)(f"{what}: weight {name!r}: {exc.message}") from None
    sid = va >> OFFSET_BITS
    arena = next((dev for dev, (first, n) in session.arenas.items() if first <= sid < first + n), None)
    if arena is not None:
        kind = resources.devices[arena].kind
        for i, node in enumerate(spec.nodes):
            if any(n in spec.offsets for n in (*node.inputs, *node.outputs)):
                refs = [spec.tensors[n] for n in node.inputs], [spec.tensors[n] for n in node.outputs]
                try:
                    REGISTRY.lookup(node.op, signature(*refs), kind)
                except E.TransferError as exc:
                    raise type(exc)(f"{what}, node {i}: {exc.message} (its intermediates live on device {arena})") from None
    _alloc(resources, session, va, spec.scratch_nbytes, spec.device, "graph", where)
    seg = resources.table.get(sid)
    assert seg is not None
    seg.info["graph"] = GraphPlan(spec, seg, site)
    seg.info["site"] = site


def _cached(session: Session, kind: str, ref: tuple[int, int]) -> tuple[Any, str]:
    obj_id, version = ref
    entry = session.defs.get((kind, obj_id))
    if entry is None:
        raise E.InvalidField(f"{kind} #{obj_id} was never defined in this session")
    have, value, site = entry
    if have != version:
        raise E.InvalidField(f"{kind} #{obj_id} (created at {site}) is at version {have} here, the request uses {version}: stale")
    return value, site


def resolve(session: Session, req: P.ComputeRef) -> P.Compute:
    """A ComputeRef becomes the Compute its cached definitions describe."""
    if len(req.plan) != 1:
        raise E.InvalidField("ComputeRef names exactly one plan")
    (op, params, device, placement), _ = _cached(session, "plan", req.plan[0])
    ins: list[TensorRef] = [_cached(session, "tensor", r)[0] for r in req.inputs]
    outs: list[TensorRef] = [_cached(session, "tensor", r)[0] for r in req.outputs]
    return P.Compute(req.id, op, ins, outs, params, device, placement, req.stream)
