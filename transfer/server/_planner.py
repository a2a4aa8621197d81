"""The planner: a pass's requests become ops (byte ranges, device, work).

Every VA is translated against the mapping table (bounds, ownership) and
every operand checked before any op exists, so a refused request touches
nothing. Placement is decided here too (`server._placement`): device memory
decides where work runs; for host-only work the policy does.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from .. import errors as E
from .. import protocol as P
from ..addressing import MappingTable, Segment, SegmentKind, make_va
from ..backends import Answer, Span, Then
from ..kernels import OPERATORS, REGISTRY, TensorRef, signature, tensor_extent, tensor_nbytes
from ._graphrun import plan_graph
from ._inline import InlineRuns
from ._ops import Op, Range
from ._placement import Placement, VirtualDevice
from ._remoteplan import RemotePlan, names_remote, plan_remote_copy, pull_input, remote_op, remote_plan

__all__ = ["Planner", "Refusal"]

_KIND_NAMES = {P.Copy: "copy", P.CopyV: "copyv", P.Fill: "fill", P.Checksum: "checksum", P.ChecksumV: "checksum", P.Compute: "compute", P.RunGraph: "compute"}
#: Remote copy vectors of at most this many pieces have their plans kept for the same vector
#: again (`Planner._copies`), at most this many plans in all (then they start over): ~14 MB
#: at worst, ~13 KB a 64-piece plan with its key.
_RECALL_PIECES = 64
_RECALL_PLANS = 1024
#: A request refused at planning: (id, route, error).
Refusal = tuple[int, int, E.TransferError]


#: A vector of copies translated: (dst segment ids, dst offsets, src segment ids, src offsets,
#: segments by id, read hulls, write hulls).
_Copies = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, Any], list[Any], list[Any]]


def _rows(dsid: np.ndarray, doff: np.ndarray, ssid: np.ndarray, soff: np.ndarray, size: np.ndarray) -> list[tuple[int, int, int, int, int]]:
    """Translated copies as rows (dst segment, dst offset, src segment, src offset, nbytes) of
    Python ints: what `remote_plan` and the verified copies' checks take."""
    return list(zip(dsid.tolist(), doff.tolist(), ssid.tolist(), soff.tolist(), size.tolist()))


class Planner:
    """Turns validated requests into Ops; raises a TransferError before anything is touched."""

    def __init__(self, table: MappingTable[Any], devices: Sequence[VirtualDevice], placement: Placement, policies: dict[str, Placement]) -> None:
        self.table = table
        self.devices = list(devices)
        self.placement = placement
        self.policies = policies
        #: The CPU devices' backend: its memory is what their processes can map (staging).
        self.host_backend = next(d.backend for d in self.devices if d.kind == "cpu")
        #: The RDMA data plane (server._remote.RemotePlane), set by the server.
        self.remote: Any = None
        #: Graph runs' placements by (graph, session, bound VAs) (server/_graphrun.py), dropped
        #: whenever the table changes under them.
        self.graph_runs: dict[tuple[Any, ...], list[Any]] = {}
        #: Those runs bound for the ring workers to run themselves (`_inline`); dropped with them.
        self.inline = InlineRuns()
        table.on_change = self._table_changed
        #: The daemon's counters (`Accounting.counters`), set by the server: copies and fills of
        #: GPU memory planned here are the Python pass's ("python_device_requests").
        self.counters: dict[str, int] = {}

    def _table_changed(self) -> None:
        self.graph_runs.clear()
        self.inline.clear()

    # --- helpers -------------------------------------------------------------------------------
    def _translate(self, owner: Any, va: int, nbytes: int) -> tuple[Segment[Any], int]:
        seg, off = self.table.translate(va, nbytes, owner)
        if seg.kind == SegmentKind.REMOTE:
            raise E.InvalidField(
                f"VA {va:#x} is in a remote (NIXL) segment: only copies may name it; "
                "copy it into a daemon buffer first (fill, checksum and compute need local memory)"
            )
        return seg, off

    def _device_of(self, segs: Iterable[Segment[Any]], nbytes: int, pinned: int = -1, policy: str = "", work: int = 0) -> VirtualDevice:
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
        chooser = self.policies.get(policy) if policy else self.placement
        if chooser is None:
            raise E.InvalidField(f"unknown placement {policy!r}; choose one of {', '.join(self.policies)}")
        return chooser.choose(self.devices, nbytes, work)

    def fixed_placement(self, segs: Sequence[Segment[Any]], nbytes: int, pinned: int, policy: str, work: int,
                        dev: VirtualDevice) -> bool:
        """Whether `_device_of` gives `dev` for these operands whatever the devices' load: their
        memory decides, the work is pinned, there is one device, or the policy's choice is fixed;
        and `place` kept that device (no fallback to another kind for a missing kernel)."""
        homes = any(s.kind == SegmentKind.DEVICE for s in segs)
        if not (homes or pinned != -1 or (not policy and len(self.devices) == 1)):
            chooser = self.policies.get(policy) if policy else self.placement
            if chooser is None or not chooser.fixed(self.devices, nbytes):
                return False
        return self._device_of(segs, nbytes, pinned, policy, work) is dev

    def remote_bound(self, req: Any) -> bool:
        """Whether a queued request is a copy naming a remote segment, by its first VAs
        (unchecked: only to route; planning checks every VA)."""
        if self.remote is None or self.remote.ep is None:
            return False
        t = type(req)
        if t is P.CopyV:
            return len(req.dst) > 0 and names_remote(self.table, (int(req.dst[0]), int(req.src[0])))
        return t is P.Copy and names_remote(self.table, (req.dst, req.src))

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
            if self.remote is not None and self.remote.ep is not None and names_remote(self.table, (req.dst, req.src)):
                return plan_remote_copy(self, owner, req)
            dseg, doff = self._translate(owner, req.dst, n)
            sseg, soff = self._translate(owner, req.src, n)
            dev = self._device_of((dseg, sseg), n)
            dst, src = self._span(dseg, doff, n), self._span(sseg, soff, n)
            backend = self._copy_backend(dseg, sseg, dev)
            if dev.kind == "gpu" and self.counters:
                self.counters["python_device_requests"] += 1
            op = Op(req.id, [(sseg.id, soff, soff + n)], [(dseg.id, doff, doff + n)], dev, n, lambda: backend.copy(dst, src),
                    host_only=dseg.kind == sseg.kind == SegmentKind.HOST)
            # Only same-backend copies merge (a merged copy runs on the op's device backend).
            if backend is dev.backend:
                op.copy = (dseg.id, sseg.id, dst, src)
            return op
        if isinstance(req, P.Fill):
            seg, off = self._translate(owner, req.dst, req.nbytes)
            dev = self._device_of((seg,), req.nbytes)
            span, value, backend = self._span(seg, off, req.nbytes), req.value, dev.backend
            if dev.kind == "gpu" and self.counters:
                self.counters["python_device_requests"] += 1
            return Op(req.id, [], [(seg.id, off, off + req.nbytes)], dev, req.nbytes, lambda: backend.fill(span, value),
                      host_only=seg.kind == SegmentKind.HOST)
        if isinstance(req, P.Checksum):
            seg, off = self._translate(owner, req.src, req.nbytes)
            dev = self._device_of((seg,), req.nbytes)
            span, backend = self._span(seg, off, req.nbytes), dev.backend
            return Op(req.id, [(seg.id, off, off + req.nbytes)], [], dev, req.nbytes, lambda: backend.checksum(span))
        if isinstance(req, P.CopyV):
            return (self.plan_verified if req.sums else self.plan_copies)(owner, req.id, req.dst, req.src, req.nbytes)
        if isinstance(req, P.ChecksumV):
            return self.plan_checksums(owner, req.id, req.src, req.nbytes)
        if isinstance(req, P.Compute):
            return self._plan_compute(owner, req)
        if isinstance(req, P.RunGraph):
            return plan_graph(self, owner, req)
        raise E.UnknownOperation(f"{type(req).__name__} is not a data request")

    def _copy_backend(self, dseg: Segment[Any], sseg: Segment[Any], dev: VirtualDevice) -> Any:
        """A copy touching GPU memory runs on that GPU's backend; host<->host on the chosen device's."""
        for seg in (dseg, sseg):
            if seg.kind == SegmentKind.DEVICE:
                return self.devices[seg.device].backend
        return dev.backend

    def _translate_copies(self, owner: Any, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> _Copies:
        """A vector of copies validated at once (`translate_many`): per piece, its segments and
        offsets; the segments by id; the hazard hulls (per segment, what is read / written:
        conservative)."""
        dsid, doff, dsegs, writes = self.table.translate_many(dst, size, owner)
        ssid, soff, ssegs, reads = self.table.translate_many(src, size, owner)
        return dsid, doff, ssid, soff, {**dsegs, **ssegs}, reads, writes

    def _copies(self, owner: Any, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> RemotePlan | _Copies:
        """A vector of copies, validated: its `RemotePlan` when it names a remote segment, else
        its translation (`_translate_copies`).

        A remote plan is kept for the same vector again (a producer's fixed slots): then it is
        only checked against the table (`RemotePlan.holds`: the same segments, still usable by
        `owner`, still declared) instead of translated and laid out again. The plane drops
        every kept plan whenever a segment goes."""
        remote = self.remote
        key = None
        if remote is not None and remote.ep is not None and len(size) <= _RECALL_PIECES:
            key = (owner, dst.tobytes(), src.tobytes(), size.tobytes())
            plan: RemotePlan | None = remote.plans.get(key)
            if plan is not None:
                if plan.holds(self.table, owner):
                    plan.device = self._device_of(plan.local_segs, plan.nbytes)  # (placement may vary)
                    return plan
                remote.plans.pop(key, None)  # (a worker thread loading a peer may have emptied them)
        copies = self._translate_copies(owner, dst, src, size)
        dsid, doff, ssid, soff, segs, reads, writes = copies
        if not any(seg.kind == SegmentKind.REMOTE for seg in segs.values()):
            return copies
        plan = remote_plan(self, owner, _rows(dsid, doff, ssid, soff, size), segs, reads, writes)
        if key is not None and plan.nbytes:
            if len(remote.plans) >= _RECALL_PLANS:
                remote.plans.clear()
            remote.plans[key] = plan
        return plan

    def plan_copies(self, owner: Any, rid: int, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> Op:
        """Copies validated at once (`translate_many`), contiguous runs merged, executed in order."""
        n = len(size)
        if n == 0:
            return Op(rid, [], [], self.devices[0], 0, lambda: None)
        copies = self._copies(owner, dst, src, size)
        if isinstance(copies, RemotePlan):
            return remote_op(rid, copies)
        dsid, doff, ssid, soff, segs, reads, writes = copies
        total = int(size.sum(dtype=np.uint64))
        dev = self._device_of(segs.values(), total)
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
            ds, ss = segs[int(dsid[a])], segs[int(ssid[a])]
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

        return Op(rid, reads, writes, dev, total, run, host_only=all(seg.kind == SegmentKind.HOST for seg in segs.values()))

    def plan_verified(self, owner: Any, rid: int, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> Op:
        """A verified CopyV (`sums`): piece by piece, each followed by the checksum64 of its
        destination, answered as one packed uint64 array (what the native worker sums as it
        copies). With remote segments, the copies as `plan_copies` posts them; an RDMA post
        cannot sum what it moves, so once the transfer is done the daemon sums each piece's
        end (`RemoteWork.then`): a READ's destination once it has landed, a WRITE's source.
        A failed transfer fails the request with its reason, and nothing is summed."""
        if not len(size):
            return Op(rid, [], [], self.devices[0], 0, lambda: b"")
        copies = self._copies(owner, dst, src, size)
        span = self._span
        if isinstance(copies, RemotePlan):
            copy = remote_op(rid, copies)
            checksum, ends = copy.device.backend.checksum, copies.ends

            def sums() -> bytes:
                return b"".join([checksum(span(seg, o, n)).to_bytes(8, "little") for seg, o, n in ends])

            if copy.remote is None:  # nothing to move (every piece empty): the sums of nothing
                copy.run = sums
            else:
                copy.remote.then = sums  # once the transfer is done (`_waves._landed`)
            return copy
        dsid, doff, ssid, soff, segs, reads, writes = copies
        rows = _rows(dsid, doff, ssid, soff, size)
        total = int(size.sum(dtype=np.uint64))
        dev = self._device_of(segs.values(), total)
        pieces = [(span(segs[d], o, n), span(segs[s_], so, n), self._copy_backend(segs[d], segs[s_], dev)) for d, o, s_, so, n in rows]

        def run() -> bytes:
            out = np.empty(len(pieces), "<u8")
            for k, (d, s, backend) in enumerate(pieces):
                backend.copy(d, s)
                out[k] = backend.checksum(d)
            return out.tobytes()

        return Op(rid, reads, writes, dev, total, run, host_only=all(seg.kind == SegmentKind.HOST for seg in segs.values()))

    def plan_checksums(self, owner: Any, rid: int, src: np.ndarray, size: np.ndarray) -> Op:
        """Many checksums validated at once (`translate_many`) as one op, answered as one packed uint64 array."""
        sid, off, segs, hull = self.table.translate_many(src, size, owner)
        for seg in segs.values():
            if seg.kind == SegmentKind.REMOTE:
                self._translate(owner, make_va(seg.id), 0)  # raises, in a checksum's words
        total = int(size.sum(dtype=np.uint64))
        dev = self._device_of(segs.values(), total)
        backend, span = dev.backend, self._span

        def run() -> bytes:  # (spans made here, not while planning: off the loop for long vectors)
            ranges = zip(sid.tolist(), off.tolist(), size.tolist())
            return np.fromiter((backend.checksum(span(segs[s], o, n)) for s, o, n in ranges), "<u8", len(size)).tobytes()

        # Each range costs a call whatever its size: many small ones count as a page each, so
        # a long vector of tiny ranges runs off the event loop like a large one.
        return Op(rid, hull, [], dev, total, run, work=len(size) << 12)

    def _plan_compute(self, owner: Any, req: P.Compute) -> Op | list[Op]:
        op = OPERATORS.get(req.op)
        if op is None:
            raise E.UnknownOperation(f"unknown operator {req.op!r}; known: {', '.join(sorted(OPERATORS))}")
        if len(req.inputs) != op.n_inputs or len(req.outputs) != op.n_outputs:
            raise E.InvalidField(f"{req.op} takes {op.n_inputs} input(s) and {op.n_outputs} output(s)")
        op.check(req.inputs, req.outputs, req.params)
        refs = (*req.inputs, *req.outputs)
        segs: list[Any] = []
        spans: list[Span] = []
        ranges: list[Range] = []
        pulls: list[Op] = []
        work = nbytes = 0
        translate = self.table.translate
        for k, t in enumerate(refs):
            elements = tensor_nbytes(t)
            extent = elements if t.strides is None else tensor_extent(t)  # contiguous: the same
            seg, off = translate(t.va, extent, owner)
            # Element work is bounded by the bytes that really back it: repeated strides
            # (stride 0: broadcasting) may show memory several times, but never more element
            # bytes than the whole segment holds. So a 4-byte tensor cannot ask for 2**33
            # elements of work; work grows only with memory the session has been granted.
            if elements > seg.nbytes:
                raise E.InvalidField(
                    f"{req.op}: tensor {k} has {elements} bytes of elements, more than its segment "
                    f"{seg.id} holds ({seg.nbytes} bytes); repeated strides may not present more"
                )
            work += elements if elements > extent else extent
            if seg.kind == SegmentKind.REMOTE:
                seg, off = self.pull(owner, seg, off, extent, k < op.n_inputs, pulls)
            segs.append(seg)
            spans.append(Span(seg.kind, seg.handle, off, extent))
            ranges.append((seg.id, off, off + extent))
            nbytes += extent
        dev, kernel, ins, outs = self.place(req.op, op.in_place, op.n_inputs, signature(req.inputs, req.outputs),
                                             refs, segs, spans, ranges, nbytes, work, req.device, req.placement)
        reads, writes = ranges[:op.n_inputs], ranges[op.n_inputs:]
        backend, params = dev.backend, req.params
        if not pulls:
            def begin(block: bool = True) -> Answer | Then:
                answer: Answer | Then = backend.begin_compute(kernel, ins, outs, params, dev.local_id, block)
                return answer

            return Op(req.id, reads, writes, dev, nbytes, lambda: begin()(), work=work,
                      begin=begin if backend.out_of_process else None)

        def run() -> Any:
            try:
                for pull in pulls:
                    if pull.error is not None:
                        raise pull.error  # the input never arrived: this request fails with the reason
                return backend.compute(kernel, ins, outs, params, dev.local_id)
            finally:
                self.release_pulls(pulls)

        return [*pulls, Op(req.id, reads, writes, dev, nbytes, run, work=work)]

    def pull(self, owner: Any, seg: Segment[Any], off: int, extent: int, is_input: bool, pulls: list[Op]) -> tuple[Any, int]:
        """A compute operand in a remote segment: an input is pulled first (one NIXL READ into
        a staging buffer, whose synthetic segment makes the compute wait for the pull); an
        output is refused."""
        if not is_input:
            raise E.InvalidField("compute cannot write a remote segment: write a daemon buffer, then copy it out")
        pull, staged, soff = pull_input(self, owner, seg, off, extent)
        pulls.append(pull)
        return staged, soff

    def release_pulls(self, pulls: list[Op]) -> None:
        for pull in pulls:
            self.remote.release_staging(pull.info)

    def place(self, name: str, in_place: bool, n_in: int, sig: tuple[str, ...], refs: Sequence[TensorRef], segs: Sequence[Any],
               spans: Sequence[Span], ranges: Sequence[Range], nbytes: int, work: int, pinned: int, policy: str,
               ) -> tuple[VirtualDevice, Any, list[tuple[TensorRef, Span]], list[tuple[TensorRef, Span]]]:
        """The rest of planning one compute once its operands are translated (per operand,
        inputs then outputs: its ref, segment, span and hazard range): the overlap rule, the
        device (the placement rule), the kernel by dtype signature.
        Returns (device, kernel, input (ref, span)s, output (ref, span)s)."""
        # Outputs must not overlap inputs (or each other), unless the operator works in place
        # and the output is exactly its first input (the same range seen the same way).
        for k in range(n_in, len(ranges)):
            ws, wa, wb = ranges[k]
            for j in range(k):
                rs, ra, rb = ranges[j]
                if ws == rs and wa < rb and ra < wb:
                    out, first = refs[k], refs[0]
                    same = (in_place and j == 0 and (wa, wb) == (ra, rb)
                            and (out.dtype, out.shape, out.strides) == (first.dtype, first.shape, first.strides))
                    if not same:
                        raise E.InvalidField(f"{name}: output {k - n_in} overlaps {'input' if j < n_in else 'output'} {j if j < n_in else j - n_in}")
        dev = self._device_of(segs, nbytes, pinned, policy, work)
        # The kernel by dtype signature; a light operator the device has no kernel for may run
        # on a device of the registry's fallback kind, when its operands are all host memory.
        kernel = REGISTRY.get(name, sig, dev.kind)
        if kernel is None:
            host_only = pinned == -1 and all(seg.kind == SegmentKind.HOST for seg in segs)
            kind, kernel = REGISTRY.select(name, sig, dev.kind, {d.kind for d in self.devices} if host_only else ())
            if kind != dev.kind:
                dev = min((d for d in self.devices if d.kind == kind), key=lambda d: (d.queued_bytes, d.index))
        return dev, kernel, list(zip(refs[:n_in], spans[:n_in])), list(zip(refs[n_in:], spans[n_in:]))
