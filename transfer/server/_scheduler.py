"""The batching scheduler: plan, split into hazard-free waves, coalesce, execute.

One *pass* takes everything queued for a session (no timer: whatever has
arrived) up to the next control request. Each data request is translated
(bounds, ownership) into an `Op` with the byte ranges it reads and writes.
Ops are then cut into *waves* in arrival order: an op starts a new wave
when it conflicts with the current one (read-after-write, write-after-read,
write-after-write on overlapping ranges). Inside a wave nothing conflicts, so
ops may run in any order, on several devices at once, and copies that
continue one another are merged into one. Waves run one after the other, so
the bytes end up exactly as one-at-a-time execution in arrival order would
leave them (tests/test_scheduler.py proves it with hypothesis).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import trio

from .. import errors as E
from .. import protocol as P
from ..addressing import MappingTable, Segment, SegmentKind
from ..backends import Span
from ..kernels import OPERATORS, REGISTRY, Placement, TensorRef, VirtualDevice, tensor_extent

__all__ = ["Op", "Planner", "plan_requests", "assign_waves", "coalesce", "execute_waves", "run_wave_inline", "replies_for"]

Range = tuple[int, int, int]  # (segment id, start offset, end offset)


@dataclass(slots=True, eq=False)
class Op:
    """One planned request: what it touches, where it runs, how."""

    rid: int
    reads: list[Range]
    writes: list[Range]
    device: VirtualDevice
    nbytes: int
    run: Callable[[], Any] | None = None
    #: Plain copies keep their spans so a wave can merge them.
    copy: tuple[int, int, Span, Span] | None = None  # (dst segment id, src segment id, dst, src)
    result: Any = None
    error: E.TransferError | None = None
    #: Further requests this op completes (a run of plain copies planned as one vector).
    more_rids: list[int] | None = None


class _Intervals:
    """Disjoint, sorted half-open intervals; inserting merges (a union of ranges)."""

    __slots__ = ("starts", "ends")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def overlaps(self, a: int, b: int) -> bool:
        if a >= b:
            return False
        i = bisect_right(self.starts, a) - 1
        if i >= 0 and self.ends[i] > a:
            return True
        return i + 1 < len(self.starts) and self.starts[i + 1] < b

    def add(self, a: int, b: int) -> None:
        if a >= b:
            return
        starts, ends = self.starts, self.ends
        if not starts or a > ends[-1]:  # the common case: ranges arrive in ascending order
            starts.append(a)
            ends.append(b)
            return
        if a >= starts[-1]:  # touches or overlaps the last interval
            if b > ends[-1]:
                ends[-1] = b
            return
        i = bisect_right(starts, a)
        if i > 0 and ends[i - 1] >= a:  # touches or overlaps the one before
            i -= 1
            a = starts[i]
        j = i
        while j < len(starts) and starts[j] <= b:
            b = max(b, ends[j])
            j += 1
        starts[i:j] = [a]
        ends[i:j] = [b]


def assign_waves(ops: Sequence[Op]) -> list[list[Op]]:
    """Cut ops (in arrival order) into consecutive waves with no internal hazard."""
    waves: list[list[Op]] = []
    cur: list[Op] = []
    reads: dict[int, _Intervals] = defaultdict(_Intervals)
    writes: dict[int, _Intervals] = defaultdict(_Intervals)
    for op in ops:
        conflict = False
        for s, a, b in op.reads:
            w = writes.get(s)
            if w is not None and w.overlaps(a, b):
                conflict = True
                break
        if not conflict:
            for s, a, b in op.writes:
                w, r = writes.get(s), reads.get(s)
                if (w is not None and w.overlaps(a, b)) or (r is not None and r.overlaps(a, b)):
                    conflict = True
                    break
        if conflict and cur:
            waves.append(cur)
            cur = []
            reads = defaultdict(_Intervals)
            writes = defaultdict(_Intervals)
        cur.append(op)
        for s, a, b in op.reads:
            reads[s].add(a, b)
        for s, a, b in op.writes:
            writes[s].add(a, b)
    if cur:
        waves.append(cur)
    return waves


def coalesce(wave: Sequence[Op]) -> list[tuple[list[Op], Callable[[], Any] | None]]:
    """Group a wave's ops into executable units; copies that continue each other become one.

    Safe because nothing in a wave conflicts: order inside a wave is free.
    Returns (ops the unit completes, work) pairs; work None means already failed.
    """
    units: list[tuple[list[Op], Callable[[], Any] | None]] = []
    copies: dict[tuple[int, int, int], list[Op]] = defaultdict(list)
    for op in wave:
        if op.copy is not None:
            copies[(op.copy[0], op.copy[1], op.device.index)].append(op)
        else:
            units.append(([op], op.run))
    for group in copies.values():
        group.sort(key=lambda o: o.copy[2].offset)  # type: ignore[index]
        run: list[Op] = [group[0]]
        for op in group[1:]:
            last_dst, last_src = run[-1].copy[2], run[-1].copy[3]  # type: ignore[index]
            dst, src = op.copy[2], op.copy[3]  # type: ignore[index]
            if dst.offset == last_dst.offset + last_dst.nbytes and src.offset == last_src.offset + last_src.nbytes:
                run.append(op)
            else:
                units.append(_merged(run))
                run = [op]
        units.append(_merged(run))
    return units


def _merged(run: list[Op]) -> tuple[list[Op], Callable[[], Any] | None]:
    if len(run) == 1:
        return run, run[0].run
    first_dst, first_src = run[0].copy[2], run[0].copy[3]  # type: ignore[index]
    total = sum(o.copy[2].nbytes for o in run)  # type: ignore[index]
    dst = first_dst._replace(nbytes=total)
    src = first_src._replace(nbytes=total)
    backend = run[0].device.backend
    return run, lambda: backend.copy(dst, src)


def _run_units(units: Sequence[tuple[list[Op], Callable[[], Any] | None]], device: VirtualDevice) -> None:
    for ops, work in units:
        if work is None:
            continue
        try:
            result = work()
        except E.TransferError as exc:
            for op in ops:
                op.error = exc
            continue
        except Exception as exc:  # a backend failure fails these requests, not the daemon
            err = E.BackendError(f"{type(exc).__name__}: {exc}")
            for op in ops:
                op.error = err
            continue
        for op in ops:
            op.result = result
    device.backend.synchronize_device(device.local_id)


def run_wave_inline(wave: Sequence[Op]) -> None:
    """Execute one wave on the calling thread (small work: cheaper than a thread hop)."""
    by_device: dict[int, list[Op]] = defaultdict(list)
    for op in wave:
        by_device[op.device.index].append(op)
    for ops in by_device.values():
        _run_units(coalesce(ops), ops[0].device)


async def execute_waves(
    waves: Sequence[Sequence[Op]],
    limiters: dict[int, trio.CapacityLimiter],
    inline_bytes: int,
) -> None:
    """Run waves in order; inside a wave, each device's share runs on that device's worker."""
    for wave in waves:
        by_device: dict[int, list[Op]] = defaultdict(list)
        for op in wave:
            by_device[op.device.index].append(op)
        jobs = []
        for ops in by_device.values():
            device = ops[0].device
            units = coalesce(ops)
            nbytes = sum(o.nbytes for o in ops)
            if nbytes < inline_bytes:
                _run_units(units, device)
            else:
                jobs.append((units, device, nbytes))
        if not jobs:
            continue
        if len(jobs) == 1:
            units, device, nbytes = jobs[0]
            await _on_device(units, device, nbytes, limiters[device.index])
            continue
        async with trio.open_nursery() as nursery:
            for units, device, nbytes in jobs:
                nursery.start_soon(_on_device, units, device, nbytes, limiters[device.index])


async def _on_device(units: Any, device: VirtualDevice, nbytes: int, limiter: trio.CapacityLimiter) -> None:
    device.queued_bytes += nbytes
    try:
        await trio.to_thread.run_sync(_run_units, units, device, limiter=limiter)
    finally:
        device.queued_bytes -= nbytes
        device.completed += 1


class Planner:
    """Turns validated requests into Ops; raises a TransferError before anything is touched."""

    def __init__(self, table: MappingTable[Any], devices: Sequence[VirtualDevice], placement: Placement, policies: dict[str, Placement]) -> None:
        self.table = table
        self.devices = list(devices)
        self.placement = placement
        self.policies = policies

    # --- helpers -------------------------------------------------------------------------------
    def _translate(self, owner: Any, va: int, nbytes: int) -> tuple[Segment[Any], int]:
        seg, off = self.table.translate(va, nbytes, owner)
        if seg.kind == SegmentKind.REMOTE:
            raise E.InvalidField("remote segments are served by the RDMA data plane (not enabled in this daemon)")
        return seg, off

    def _device_of(self, segs: Iterable[Segment[Any]], nbytes: int, pinned: int = -1, policy: str = "") -> VirtualDevice:
        """The placement rule: device memory decides; else the policy (or the pinned device)."""
        homes = {s.device for s in segs if s.kind == SegmentKind.DEVICE}
        if len(homes) > 1:
            raise E.InvalidField(f"operands live on different devices {sorted(homes)}: copy them to one device first")
        if homes:
            (home,) = homes
            if pinned not in (-1, home):
                raise E.InvalidField(f"operands live on device {home}, the request pins device {pinned}")
            return self.devices[home]
        if pinned == -1 and not policy and len(self.devices) == 1:
            return self.devices[0]
        if pinned != -1:
            if not 0 <= pinned < len(self.devices):
                raise E.InvalidField(f"device {pinned} does not exist (this daemon has {len(self.devices)})")
            return self.devices[pinned]
        chooser = self.placement
        if policy:
            chooser = self.policies.get(policy)  # type: ignore[assignment]
            if chooser is None:
                raise E.InvalidField(f"unknown placement {policy!r}; choose one of {', '.join(self.policies)}")
        return chooser.choose(self.devices, nbytes)

    @staticmethod
    def _span(seg: Segment[Any], off: int, nbytes: int) -> Span:
        return Span(seg.kind, seg.handle, off, nbytes)

    # --- requests -------------------------------------------------------------------------------
    def plan(self, owner: Any, req: P.Request) -> Op:
        if isinstance(req, P.Copy):
            n = req.nbytes
            dseg, doff = self._translate(owner, req.dst, n)
            sseg, soff = self._translate(owner, req.src, n)
            dev = self._device_of((dseg, sseg), n)
            dst, src = self._span(dseg, doff, n), self._span(sseg, soff, n)
            backend = self._copy_backend(dseg, sseg, dev)
            op = Op(req.id, [(sseg.id, soff, soff + n)], [(dseg.id, doff, doff + n)], dev, n, lambda: backend.copy(dst, src))
            # Only same-backend copies merge (a merged copy runs on the op's device backend).
            if backend is dev.backend:
                op.copy = (dseg.id, sseg.id, dst, src)
            return op
        if isinstance(req, P.Fill):
            seg, off = self._translate(owner, req.dst, req.nbytes)
            dev = self._device_of((seg,), req.nbytes)
            span, value, backend = self._span(seg, off, req.nbytes), req.value, dev.backend
            return Op(req.id, [], [(seg.id, off, off + req.nbytes)], dev, req.nbytes, lambda: backend.fill(span, value))
        if isinstance(req, P.Checksum):
            seg, off = self._translate(owner, req.src, req.nbytes)
            dev = self._device_of((seg,), req.nbytes)
            span, backend = self._span(seg, off, req.nbytes), dev.backend
            return Op(req.id, [(seg.id, off, off + req.nbytes)], [], dev, req.nbytes, lambda: backend.checksum(span))
        if isinstance(req, P.CopyV):
            return self._plan_vector(owner, req)
        if isinstance(req, P.Compute):
            return self._plan_compute(owner, req)
        raise E.UnknownOperation(f"{type(req).__name__} is not a data request")

    def _copy_backend(self, dseg: Segment[Any], sseg: Segment[Any], dev: VirtualDevice) -> Any:
        """A copy touching GPU memory runs on that GPU's backend; host<->host on the chosen device's."""
        for seg in (dseg, sseg):
            if seg.kind == SegmentKind.DEVICE:
                return self.devices[seg.device].backend
        return dev.backend

    def _plan_vector(self, owner: Any, req: P.CopyV) -> Op:
        return self._plan_copies(owner, req.id, req.dst, req.src, req.nbytes)

    def plan_copy_run(self, owner: Any, reqs: Sequence[P.Copy]) -> Op:
        """Consecutive plain copies as one vector op (same semantics: in order); one reply each."""
        n = len(reqs)
        dst = np.fromiter((r.dst for r in reqs), np.uint64, n)
        src = np.fromiter((r.src for r in reqs), np.uint64, n)
        size = np.fromiter((r.nbytes for r in reqs), np.uint64, n)
        op = self._plan_copies(owner, reqs[0].id, dst, src, size)
        op.more_rids = [r.id for r in reqs[1:]]
        return op

    def _plan_copies(self, owner: Any, rid: int, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> Op:
        """Copies validated with NumPy, contiguous runs merged, executed in order."""
        n = len(size)
        if n == 0:
            return Op(rid, [], [], self.devices[0], 0, lambda: None)
        table = self.table
        dsid, doff, dsegs = table.translate_many(dst, size, owner)
        ssid, soff, ssegs = table.translate_many(src, size, owner)
        segs = {**dsegs, **ssegs}
        for seg in segs.values():
            if seg.kind == SegmentKind.REMOTE:
                raise E.InvalidField("remote segments are served by the RDMA data plane (not enabled in this daemon)")
        total = int(size.sum(dtype=np.uint64))
        dev = self._device_of(segs.values(), total)
        # Hazard ranges: per segment, the hull of what is read / written (conservative).
        reads = _hulls(ssid, soff, size)
        writes = _hulls(dsid, doff, size)
        cont = np.zeros(n, dtype=bool)
        if n > 1:
            cont[1:] = (
                (dsid[1:] == dsid[:-1])
                & (ssid[1:] == ssid[:-1])
                & (doff[1:] == doff[:-1] + size[:-1])
                & (soff[1:] == soff[:-1] + size[:-1])
            )
        starts = np.flatnonzero(~cont)
        ends = np.append(starts[1:], n)
        csum = np.concatenate(([0], np.cumsum(size, dtype=np.uint64)))
        pairs: list[tuple[Span, Span, Any]] = []
        for a, b in zip(starts.tolist(), ends.tolist()):
            run_bytes = int(csum[b] - csum[a])
            ds, ss = dsegs[int(dsid[a])], ssegs[int(ssid[a])]
            do, so = int(doff[a]), int(soff[a])
            backend = self._copy_backend(ds, ss, dev)
            if b - a > 1 and ds is ss and do < so + run_bytes and so < do + run_bytes:
                # An overlapping run: one memmove would differ from piece-by-piece copies.
                for k in range(a, b):
                    nb = int(size[k])
                    pairs.append((self._span(ds, int(doff[k]), nb), self._span(ss, int(soff[k]), nb), backend))
                continue
            pairs.append((self._span(ds, do, run_bytes), self._span(ss, so, run_bytes), backend))

        def run() -> None:
            for d, s, backend in pairs:
                backend.copy(d, s)

        return Op(rid, reads, writes, dev, total, run)

    def _plan_compute(self, owner: Any, req: P.Compute) -> Op:
        op = OPERATORS.get(req.op)
        if op is None:
            raise E.UnknownOperation(f"unknown operator {req.op!r}; known: {', '.join(sorted(OPERATORS))}")
        if len(req.inputs) != op.n_inputs or len(req.outputs) != op.n_outputs:
            raise E.InvalidField(f"{req.op} takes {op.n_inputs} input(s) and {op.n_outputs} output(s)")
        op.check(req.inputs, req.outputs, req.params)
        placed: list[tuple[TensorRef, Segment[Any], int, int]] = []
        for t in (*req.inputs, *req.outputs):
            extent = tensor_extent(t)
            seg, off = self._translate(owner, t.va, extent)
            placed.append((t, seg, off, extent))
        n_in = op.n_inputs
        reads = [(seg.id, off, off + ext) for _, seg, off, ext in placed[:n_in]]
        writes = [(seg.id, off, off + ext) for _, seg, off, ext in placed[n_in:]]
        # Outputs must not overlap inputs (or each other), unless the operator works in place
        # and the output is exactly its first input.
        for k, (ws, wa, wb) in enumerate(writes):
            for j, (rs, ra, rb) in enumerate(reads + writes[:k]):
                if ws == rs and wa < rb and ra < wb:
                    same = op.in_place and j == 0 and (wa, wb) == (ra, rb) and req.outputs[k] == req.inputs[0]
                    if not same:
                        raise E.InvalidField(f"{req.op}: output {k} overlaps {'input' if j < len(reads) else 'output'} {j if j < len(reads) else j - len(reads)}")
        nbytes = sum(ext for *_, ext in placed)
        dev = self._device_of((seg for _, seg, _, _ in placed), nbytes, req.device, req.placement)
        key_dtype = (req.inputs[0] if req.inputs else req.outputs[0]).dtype
        kernel = REGISTRY.lookup(req.op, key_dtype, dev.kind)
        backend, params = dev.backend, req.params
        ins = [(t, self._span(seg, off, ext)) for t, seg, off, ext in placed[:n_in]]
        outs = [(t, self._span(seg, off, ext)) for t, seg, off, ext in placed[n_in:]]
        return Op(req.id, reads, writes, dev, nbytes, lambda: backend.compute(kernel, ins, outs, params, dev.local_id))


def _hulls(sids: np.ndarray, offs: np.ndarray, sizes: np.ndarray) -> list[Range]:
    out: list[Range] = []
    ends = offs + sizes
    for sid in np.unique(sids).tolist():
        m = sids == sid
        out.append((int(sid), int(offs[m].min()), int(ends[m].max())))
    return out


def plan_requests(planner: Planner, owner: Any, reqs: Sequence[P.Request]) -> tuple[list[Op], list[P.Reply]]:
    """Plan a pass's data requests: (ops in arrival order, error replies for refused ones).

    Runs of plain copies are planned as one vector op (validated with NumPy);
    if any copy in a run is invalid, the run is planned one by one so that
    only that copy fails.
    """
    ops: list[Op] = []
    refused: list[P.Reply] = []

    def one(req: P.Request) -> None:
        try:
            ops.append(planner.plan(owner, req))
        except E.TransferError as exc:
            refused.append(P.Reply(req.id, error=exc))
        except Exception as exc:  # a bug: fail this request, keep serving
            refused.append(P.Reply(req.id, error=E.InternalError(f"{type(exc).__name__}: {exc}")))

    run: list[P.Copy] = []

    def flush() -> None:
        if len(run) >= 8:
            try:
                ops.append(planner.plan_copy_run(owner, run))
                run.clear()
                return
            except E.TransferError:
                pass
        for r in run:
            one(r)
        run.clear()

    for req in reqs:
        if type(req) is P.Copy:
            run.append(req)
            continue
        if run:
            flush()
        one(req)
    if run:
        flush()
    return ops, refused


def replies_for(ops: Sequence[Op]) -> list[P.Reply]:
    out: list[P.Reply] = []
    for op in ops:
        out.append(P.Reply(op.rid, op.result if op.error is None else None, op.error))
        if op.more_rids:
            out.extend(P.Reply(rid, None, op.error) for rid in op.more_rids)
    return out
