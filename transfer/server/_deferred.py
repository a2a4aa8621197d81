"""Deferred creation, daemon side: arenas, definitions, cached descriptors.

The client allocates VAs from arenas granted at hello and sends each
definition (alloc, free, tensor, plan) inside the first frame that uses
it. Definitions are control requests: a pass runs them before the data
requests that follow them in the frame. Arenas are granted by `_resources`. Errors name the resource and the
place in the client's code where it was created.
"""

from __future__ import annotations

from typing import Any

from .. import errors as E
from .. import protocol as P
from ..addressing import OFFSET_BITS, SegmentKind
from ..kernels import OPERATORS, TensorRef
from ._resources import Resources
from ._session import Session

__all__ = ["define", "resolve"]


def _human(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def define(resources: Resources, session: Session, req: P.Define) -> Any:
    session.stats.defines += 1
    where = f" created at {req.site}" if req.site else ""
    d = req.definition
    if req.kind == P.DEF_ALLOC:
        if type(d) is not list or len(d) != 3 or not all(type(x) is int for x in d):
            raise E.InvalidField("alloc definition is [va, nbytes, device]")
        va, nbytes, device = d
        sid = va >> OFFSET_BITS
        if va & ((1 << OFFSET_BITS) - 1) or not any(first <= sid < first + n for first, n in session.arenas.values()):
            raise E.InvalidAddress(f"alloc{where}: VA {va:#x} is not a segment of this session's arenas")
        arena_dev = next(dev for dev, (first, n) in session.arenas.items() if first <= sid < first + n)
        if device not in (-1, arena_dev):
            raise E.InvalidField(f"alloc{where}: VA {va:#x} belongs to the arena of device {arena_dev}, not {device}")
        try:
            return resources.alloc_at(session, sid, nbytes, arena_dev)
        except E.TransferError as exc:
            raise type(exc)(f"alloc of {_human(nbytes)}{where}: {exc.message}") from None
    if req.kind == P.DEF_FREE:
        if type(d) is not int:
            raise E.InvalidField("free definition is the buffer's VA")
        seg = resources.table.lookup(d, session.id)
        if d != seg.va or seg.kind != SegmentKind.DEVICE:
            raise E.InvalidAddress(f"deferred free of {d:#x}: not a device buffer's base VA")
        resources.free(session, d, SegmentKind.DEVICE)
        return None
    if req.kind == P.DEF_TENSOR:
        (t,) = P.tensors([d], f"tensor #{req.obj}{where}")
        session.defs[("tensor", req.obj)] = (req.version, t, req.site)
        return None
    if req.kind == P.DEF_PLAN:
        if type(d) is not list or len(d) != 5:
            raise E.InvalidField(f"plan #{req.obj}{where}: definition is [op, params, device, placement, site]")
        op, params, device, placement, _site = d
        if type(op) is not str or op not in OPERATORS:
            raise E.UnknownOperation(f"plan #{req.obj}{where}: unknown operator {op!r}")
        P.params(params, f"plan #{req.obj}.params")
        P.i32(device, f"plan #{req.obj}.device")
        P.text(32)(placement, f"plan #{req.obj}.placement")
        session.defs[("plan", req.obj)] = (req.version, (op, params, device, placement), req.site)
        return None
    raise E.InvalidField(f"unknown definition kind {req.kind}")


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
