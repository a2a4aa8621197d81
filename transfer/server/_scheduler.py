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

import itertools
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import trio

from .. import errors as E
from .. import protocol as P
from ..addressing import MappingTable, Segment, SegmentKind
from ..backends import Span
from ..transport._remote import RemoteWork
from ..kernels import OPERATORS, REGISTRY, Placement, TensorRef, VirtualDevice, tensor_extent

__all__ = ["Op", "Planner", "plan_requests", "assign_waves", "coalesce", "execute_waves", "run_wave_inline", "replies_for"]

Range = tuple[int, int, int]  # (segment id, start offset, end offset)
_KIND_NAMES = {P.Copy: "copy", P.CopyV: "copyv", P.Fill: "fill", P.Checksum: "checksum", P.Compute: "compute"}


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
    #: The request kind, for metrics ("copy", "fill", "compute", ...).
    kind: str = "copy"
    #: Extra state an op keeps for its execution (a staging buffer's registration).
    info: Any = None
    #: Copies to or from a remote (NIXL) segment: posted with the rest of the wave's, as one transfer.
    remote: Any = None
    #: Descriptor id(s) when the op came through the session's ring: answered there, not by a reply.
    ring_ids: Any = None


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


def _remote_groups(wave: Sequence[Op]) -> tuple[list[Op], list[list[Op]]]:
    """Split a wave: (local ops, remote ops grouped by (plane, peer, direction)).

    Nothing in a wave conflicts, so each group can be ONE NIXL transfer whose
    descriptor list is the concatenation of its ops' ranges.
    """
    local: list[Op] = []
    groups: dict[tuple[int, str, str], list[Op]] = {}
    for op in wave:
        w = op.remote
        if w is None:
            local.append(op)
        else:
            groups.setdefault((id(w.plane), w.peer, w.op), []).append(op)
    return local, list(groups.values())


def _group_ranges(ops: Sequence[Op]) -> tuple[np.ndarray, np.ndarray]:
    if len(ops) == 1:
        return ops[0].remote.local, ops[0].remote.remote
    return np.concatenate([o.remote.local for o in ops]), np.concatenate([o.remote.remote for o in ops])


def _fail_ops(ops: Sequence[Op], exc: BaseException) -> None:
    err = exc if isinstance(exc, E.TransferError) else E.BackendError(f"{type(exc).__name__}: {exc}")
    for op in ops:
        op.error = err


async def _post_remote_on_loop(ops: Sequence[Op]) -> None:
    """Small groups: post from the loop (a same-host post of < inline_bytes takes tens of
    microseconds, less than a thread hop), then poll with short sleeps until done."""
    w = ops[0].remote
    local, remote = _group_ranges(ops)
    try:
        xfer = w.plane.start(w.peer, w.op, local, remote)
        delay = 20e-6
        # Shielded: a cancelled session must not free memory a transfer still writes into
        # (the wait is bounded by the plane's timeout; a dead peer fails it within ms).
        with trio.CancelScope(shield=True):
            while not w.plane.finish(xfer, wait=False):
                await trio.sleep(delay)
                delay = min(delay * 2, 1e-3)
    except Exception as exc:  # a NIXL failure fails these requests, not the daemon
        _fail_ops(ops, exc)


def _post_remote(ops: Sequence[Op]) -> None:
    """Post one group as one transfer and wait (blocking: a worker thread's job)."""
    w = ops[0].remote
    local, remote = _group_ranges(ops)
    try:
        w.plane.post(w.peer, w.op, local, remote)
    except E.TransferError as exc:
        for op in ops:
            op.error = exc
    except Exception as exc:  # a NIXL failure fails these requests, not the daemon
        err = E.BackendError(f"{type(exc).__name__}: {exc}")
        for op in ops:
            op.error = err


def run_wave_inline(wave: Sequence[Op]) -> None:
    """Execute one wave on the calling thread (small work: cheaper than a thread hop)."""
    by_device: dict[int, list[Op]] = defaultdict(list)
    wave, remote_groups = _remote_groups(wave)
    for group in remote_groups:
        _post_remote(group)
    for op in wave:
        by_device[op.device.index].append(op)
    for ops in by_device.values():
        _run_units(coalesce(ops), ops[0].device)


async def execute_waves(
    waves: Sequence[Sequence[Op]],
    limiters: dict[int, trio.CapacityLimiter],
    inline_bytes: int,
) -> None:
    """Run waves in order; inside a wave, each device's share runs on that device's worker.

    A wave's remote copies are posted as one NIXL transfer per (peer, direction),
    on a worker thread (a same-host READ copies inside the post), concurrently
    with the wave's local work.
    """
    for wave in waves:
        by_device: dict[int, list[Op]] = defaultdict(list)
        wave, remote_groups = _remote_groups(wave)
        for op in wave:
            by_device[op.device.index].append(op)
        jobs: list[Any] = []
        big = []
        for group in remote_groups:
            # Posting from the loop blocks it only while a same-host (cma) post copies
            # in place: <= 1 MiB is ~80 us, far less than two thread hops on 2 cores.
            # NIC and tcp posts return at once whatever the size (then we poll).
            if sum(o.nbytes for o in group) <= max(4 * inline_bytes, 1 << 20):
                jobs.append(([group], None, -1))  # posted from the loop
            else:
                big.append(group)
        if big:
            jobs.append((big, None, 0))
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
            await _on_device(units, device, nbytes, None if device is None else limiters[device.index])
            continue
        async with trio.open_nursery() as nursery:
            for units, device, nbytes in jobs:
                nursery.start_soon(_on_device, units, device, nbytes, None if device is None else limiters[device.index])


async def _on_device(units: Any, device: VirtualDevice | None, nbytes: int, limiter: trio.CapacityLimiter | None) -> None:
    if device is None:  # the wave's remote groups (units): one NIXL post each
        for group in units:
            if nbytes < 0:
                await _post_remote_on_loop(group)
            else:
                await trio.to_thread.run_sync(_post_remote, group, limiter=_remote_limiter())
        return
    device.queued_bytes += nbytes
    try:
        await trio.to_thread.run_sync(_run_units, units, device, limiter=limiter)
    finally:
        device.queued_bytes -= nbytes
        device.completed += 1


_REMOTE_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("transfer_remote_limiter")


def _remote_limiter() -> trio.CapacityLimiter:
    """Threads posting NIXL transfers (one limiter per trio run; posts block, briefly)."""
    try:
        return _REMOTE_LIMITER.get()
    except LookupError:
        lim = trio.CapacityLimiter(2)
        _REMOTE_LIMITER.set(lim)
        return lim


class Planner:
    """Turns validated requests into Ops; raises a TransferError before anything is touched."""

    def __init__(self, table: MappingTable[Any], devices: Sequence[VirtualDevice], placement: Placement, policies: dict[str, Placement]) -> None:
        self.table = table
        self.devices = list(devices)
        self.placement = placement
        self.policies = policies
        #: The RDMA data plane (transfer.transport._remote.RemotePlane), set by the server.
        self.remote: Any = None

    # --- helpers -------------------------------------------------------------------------------
    def _translate(self, owner: Any, va: int, nbytes: int) -> tuple[Segment[Any], int]:
        seg, off = self.table.translate(va, nbytes, owner)
        if seg.kind == SegmentKind.REMOTE:
            raise E.InvalidField(
                f"VA {va:#x} is in a remote (NIXL) segment: only copies may name it; "
                "copy it into a daemon buffer first (fill, checksum and compute need local memory)"
            )
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
    def plan(self, owner: Any, req: P.Request) -> Op | list[Op]:
        """One op per request; a compute with remote inputs also gets the ops that pull them."""
        out = self._plan(owner, req)
        kind = _KIND_NAMES.get(type(req), "other")
        for op in out if isinstance(out, list) else (out,):
            op.kind = kind
        return out

    def _plan(self, owner: Any, req: P.Request) -> Op | list[Op]:
        if isinstance(req, P.Copy):
            n = req.nbytes
            if self.remote is not None and self._names_remote(owner, (req.dst, req.src)):
                return self._plan_remote_copy(owner, req)
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
        if any(seg.kind == SegmentKind.REMOTE for seg in segs.values()):
            return self._plan_remote_copies(owner, rid, dsid, doff, ssid, soff, size, dsegs, ssegs)
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

    def _names_remote(self, owner: Any, vas: Iterable[int]) -> bool:
        for va in vas:
            seg = self.table.get(va >> 40)
            if seg is not None and seg.kind == SegmentKind.REMOTE:
                return True
        return False

    def _plan_remote_copy(self, owner: Any, req: P.Copy) -> Op:
        """One copy to or from a remote segment: the same checks as the vector path, in plain
        Python (NumPy's per-call overhead would dominate for one descriptor)."""
        plane, n = self.remote, req.nbytes
        dseg, doff = self.table.translate(req.dst, n, owner)
        sseg, soff = self.table.translate(req.src, n, owner)
        d_rem, s_rem = dseg.kind == SegmentKind.REMOTE, sseg.kind == SegmentKind.REMOTE
        if d_rem and s_rem:
            raise E.InvalidField("a copy between two remote segments is not supported: copy through a daemon buffer")
        rseg, roff, lseg, loff = (dseg, doff, sseg, soff) if d_rem else (sseg, soff, dseg, doff)
        if rseg.owner != owner:
            raise E.NotOwner(f"remote segment {rseg.id} belongs to another session (remote segments are not shareable)")
        dev = self._device_of((lseg,), n)
        reads, writes = [(sseg.id, soff, soff + n)], [(dseg.id, doff, doff + n)]
        if n == 0:
            return Op(req.id, reads, writes, dev, 0, lambda: None)
        handle = rseg.handle
        raddr = handle.addr + roff
        plane.check_remote_one(handle, raddr, n)
        laddr = plane.local_base(lseg) + loff
        work = RemoteWork(
            plane, handle.peer, "WRITE" if d_rem else "READ",
            np.array([[laddr, n]], dtype=np.uint64), np.array([[raddr, n]], dtype=np.uint64),
        )
        return Op(req.id, reads, writes, dev, n, lambda: plane.post(work.peer, work.op, work.local, work.remote), remote=work)

    def _plan_remote_copies(
        self, owner: Any, rid: int, dsid: np.ndarray, doff: np.ndarray, ssid: np.ndarray, soff: np.ndarray,
        size: np.ndarray, dsegs: dict[int, Segment[Any]], ssegs: dict[int, Segment[Any]],
    ) -> Op:
        """Copies between a remote (NIXL) segment and the daemon's memory: one descriptor list.

        All READs (remote -> local) or all WRITEs (local -> remote), with one peer.
        Bounds and ownership were checked by the table; here the remote side is
        checked again against what the producer declared (check_ranges_within),
        and destinations must not overlap (one RDMA post has no order inside).
        """
        plane = self.remote
        if plane is None:
            raise E.InvalidField("remote segments are served by the RDMA data plane (not enabled in this daemon)")
        keep = size > 0
        if not keep.all():
            dsid, doff, ssid, soff, size = dsid[keep], doff[keep], ssid[keep], soff[keep], size[keep]
        segs = {**dsegs, **ssegs}
        remote_ids = [sid for sid, seg in segs.items() if seg.kind == SegmentKind.REMOTE]
        for sid in remote_ids:
            if segs[sid].owner != owner:
                raise E.NotOwner(f"remote segment {sid} belongs to another session (remote segments are not shareable)")
        rid_arr = np.array(remote_ids, dtype=np.uint64)
        d_rem, s_rem = np.isin(dsid, rid_arr), np.isin(ssid, rid_arr)
        if (d_rem & s_rem).any():
            raise E.InvalidField("a copy between two remote segments is not supported: copy through a daemon buffer")
        if (~d_rem & ~s_rem).any():
            raise E.InvalidField("a vector mixing remote and local-only copies: send them as separate requests")
        if d_rem.any() and s_rem.any():
            raise E.InvalidField("a vector mixing reads from and writes to remote segments: send them as separate requests")
        op = "WRITE" if d_rem.any() else "READ"
        lsid, loff, rsid, roff = (ssid, soff, dsid, doff) if op == "WRITE" else (dsid, doff, ssid, soff)
        n = len(size)
        total = int(size.sum(dtype=np.uint64))
        local_segs = {int(s): segs[int(s)] for s in np.unique(lsid).tolist()}
        dev = self._device_of(local_segs.values(), total)
        if n == 0:
            return Op(rid, [], [], dev, 0, lambda: None)
        handles = {h.peer for h in (segs[s].handle for s in remote_ids)}
        if len(handles) != 1:
            raise E.InvalidField("copies name remote segments of several NIXL agents")
        (peer,) = handles

        def bases(sids: np.ndarray, table: dict[int, int]) -> np.ndarray:
            uniq = np.unique(sids)
            vals = np.array([table[int(s)] for s in uniq.tolist()], dtype=np.uint64)
            return vals[np.searchsorted(uniq, sids)]

        laddr = bases(lsid, {s: plane.local_base(seg) for s, seg in local_segs.items()}) + loff
        raddr = bases(rsid, {s: segs[s].handle.addr for s in remote_ids}) + roff
        remote = np.stack([raddr, size], axis=1)
        plane.check_remote(segs[remote_ids[0]].handle, remote)
        # Destinations must not overlap: inside one post, NIXL gives no order.
        dst_addr = laddr if op == "READ" else raddr
        if n > 1:
            order = np.argsort(dst_addr, kind="stable")
            sa, sz = dst_addr[order], size[order]
            clash = np.flatnonzero(sa[1:] < sa[:-1] + sz[:-1])
            if clash.size:
                i = int(order[clash[0] + 1])
                raise E.InvalidField(f"copy {i}: its destination overlaps another copy's in the same remote batch")
        reads = _hulls(ssid, soff, size)  # hazards: per segment, the hull touched
        writes = _hulls(dsid, doff, size)
        # Merge runs that continue each other on both sides (fewer descriptors).
        if n > 1:
            cont = np.zeros(n, dtype=bool)
            cont[1:] = (laddr[1:] == laddr[:-1] + size[:-1]) & (raddr[1:] == raddr[:-1] + size[:-1])
            if cont.any():
                starts = np.flatnonzero(~cont)
                csum = np.concatenate(([0], np.cumsum(size, dtype=np.uint64))).astype(np.uint64)
                ends = np.append(starts[1:], n)
                lens = csum[ends] - csum[starts]
                laddr, raddr, size = laddr[starts], raddr[starts], lens
                remote = np.stack([raddr, size], axis=1)
        local = np.stack([laddr, size], axis=1)
        work = RemoteWork(plane, peer, op, np.ascontiguousarray(local), np.ascontiguousarray(remote))
        return Op(rid, reads, writes, dev, total, lambda: plane.post(peer, op, work.local, work.remote), remote=work)

    def _plan_compute(self, owner: Any, req: P.Compute) -> Op:
        op = OPERATORS.get(req.op)
        if op is None:
            raise E.UnknownOperation(f"unknown operator {req.op!r}; known: {', '.join(sorted(OPERATORS))}")
        if len(req.inputs) != op.n_inputs or len(req.outputs) != op.n_outputs:
            raise E.InvalidField(f"{req.op} takes {op.n_inputs} input(s) and {op.n_outputs} output(s)")
        op.check(req.inputs, req.outputs, req.params)
        placed: list[tuple[TensorRef, Any, int, int]] = []
        pulls: list[Op] = []
        for k, t in enumerate((*req.inputs, *req.outputs)):
            extent = tensor_extent(t)
            seg, off = self.table.translate(t.va, extent, owner)
            if seg.kind == SegmentKind.REMOTE and k < op.n_inputs:
                # A remote input is pulled first (one NIXL READ into a staging buffer); the
                # staging buffer's synthetic segment makes the compute wait for the pull.
                pull, seg, off = self._pull(owner, req.id, seg, off, extent)
                pulls.append(pull)
            elif seg.kind == SegmentKind.REMOTE:
                raise E.InvalidField("compute cannot write a remote segment: write a daemon buffer, then copy it out")
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
        if not pulls:
            return Op(req.id, reads, writes, dev, nbytes, lambda: backend.compute(kernel, ins, outs, params, dev.local_id))

        def run() -> Any:
            try:
                for pull in pulls:
                    if pull.error is not None:
                        raise pull.error  # the input never arrived: this request fails with the reason
                return backend.compute(kernel, ins, outs, params, dev.local_id)
            finally:
                for pull in pulls:
                    self.remote.release_staging(pull.info)

        return [*pulls, Op(req.id, reads, writes, dev, nbytes, run)]

    def _pull(self, owner: Any, rid: int, rseg: Segment[Any], roff: int, nbytes: int) -> tuple[Op, Any, int]:
        """An internal op (no reply of its own) reading a remote range into a staging buffer."""
        plane = self.remote
        if plane is None:
            raise E.InvalidField("remote segments are served by the RDMA data plane (not enabled in this daemon)")
        if rseg.owner != owner:
            raise E.NotOwner(f"remote segment {rseg.id} belongs to another session (remote segments are not shareable)")
        handle = rseg.handle
        raddr = handle.addr + roff
        plane.check_remote_one(handle, raddr, nbytes)
        arr, reg = plane.staging(nbytes)
        staged = _Staged(-next(_staging_ids), arr)
        work = RemoteWork(plane, handle.peer, "READ", np.array([[reg.addr, nbytes]], np.uint64), np.array([[raddr, nbytes]], np.uint64))
        pull = Op(
            0, [(rseg.id, roff, roff + nbytes)], [(staged.id, 0, nbytes)], self.devices[0], nbytes,
            lambda: plane.post(work.peer, work.op, work.local, work.remote), remote=work,
        )
        pull.info = reg
        return pull, staged, 0


class _Staged:
    """A staging buffer seen as a host segment (for spans and hazard ranges)."""

    kind = SegmentKind.HOST

    def __init__(self, sid: int, array: np.ndarray) -> None:
        self.id = sid
        self.array = array
        self.handle = self
        self.device = -1


_staging_ids = itertools.count(1)


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
            planned = planner.plan(owner, req)
            ops.extend(planned) if isinstance(planned, list) else ops.append(planned)
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
        if isinstance(req, P.Request):
            one(req)
        else:  # a RingBatch (server._ringpath): its descriptors, validated and planned in order
            ops.extend(req.plan_ops(planner, owner))
    if run:
        flush()
    return ops, refused


def replies_for(ops: Sequence[Op]) -> list[P.Reply]:
    out: list[P.Reply] = []
    for op in ops:
        if op.rid == 0 or op.ring_ids is not None:
            continue  # internal (a pull for a compute), or answered on the ring
        out.append(P.Reply(op.rid, op.result if op.error is None else None, op.error))
        if op.more_rids:
            out.extend(P.Reply(rid, None, op.error) for rid in op.more_rids)
    return out
