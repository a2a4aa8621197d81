"""The planner: a pass's requests become ops (byte ranges, device, work).

Every VA is translated against the mapping table (bounds, ownership) and
every operand checked before any op exists, so a refused request touches
nothing. Placement is decided here too (`server._placement`): device memory
decides where work runs; for host-only work the policy does.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Sequence

import numpy as np

from .. import errors as E
from .. import protocol as P
from ..addressing import MappingTable, Segment, SegmentKind
from ..backends import Span
from ..kernels import OPERATORS, REGISTRY, GraphSpec, TensorRef, signature, tensor_extent, tensor_nbytes
from ._ops import SOCKET, Op, hulls, lane_of
from ._placement import Placement, VirtualDevice
from ._remote import names_remote, plan_remote_copies, plan_remote_copy, pull_input

__all__ = ["Planner", "CopyRun", "Refusal", "plan_batch", "VECTOR_RUN"]

_KIND_NAMES = {P.Copy: "copy", P.CopyV: "copyv", P.Fill: "fill", P.Checksum: "checksum", P.Compute: "compute", P.RunGraph: "compute"}
#: Plain copies in a row planned as one vector op (validated with NumPy at once).
VECTOR_RUN = 8
#: A request refused at planning: (id, route, error).
Refusal = tuple[int, int, E.TransferError]


class CopyRun:
    """Copy descriptors that arrived together on a ring, as arrays: one vector op if all are valid."""

    __slots__ = ("ids", "dst", "src", "nbytes", "stream")

    def __init__(self, ids: np.ndarray, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, stream: int = 0) -> None:
        self.ids, self.dst, self.src, self.nbytes, self.stream = ids, dst, src, nbytes, stream

    def singles(self) -> list[P.Copy]:
        s = self.stream
        return [P.Copy(int(i), int(d), int(s_), int(n), s) for i, d, s_, n in zip(self.ids.tolist(), self.dst.tolist(), self.src.tolist(), self.nbytes.tolist())]


def answers(req: Any) -> int:
    """How many answers one queue entry owes: a CopyRun one per copy, anything else one."""
    return len(req.ids) if type(req) is CopyRun else 1


class Planner:
    """Turns validated requests into Ops; raises a TransferError before anything is touched."""

    def __init__(self, table: MappingTable[Any], devices: Sequence[VirtualDevice], placement: Placement, policies: dict[str, Placement]) -> None:
        self.table = table
        self.devices = list(devices)
        self.placement = placement
        self.policies = policies
        #: The RDMA data plane (server._remote.RemotePlane), set by the server.
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
            return Op(req.id, [], [(seg.id, off, off + req.nbytes)], dev, req.nbytes, lambda: backend.fill(span, value),
                      host_only=seg.kind == SegmentKind.HOST)
        if isinstance(req, P.Checksum):
            seg, off = self._translate(owner, req.src, req.nbytes)
            dev = self._device_of((seg,), req.nbytes)
            span, backend = self._span(seg, off, req.nbytes), dev.backend
            return Op(req.id, [(seg.id, off, off + req.nbytes)], [], dev, req.nbytes, lambda: backend.checksum(span))
        if isinstance(req, P.CopyV):
            return self.plan_copies(owner, req.id, req.dst, req.src, req.nbytes)
        if isinstance(req, P.Compute):
            return self._plan_compute(owner, req)
        if isinstance(req, P.RunGraph):
            return self._plan_graph(owner, req)
        raise E.UnknownOperation(f"{type(req).__name__} is not a data request")

    def _copy_backend(self, dseg: Segment[Any], sseg: Segment[Any], dev: VirtualDevice) -> Any:
        """A copy touching GPU memory runs on that GPU's backend; host<->host on the chosen device's."""
        for seg in (dseg, sseg):
            if seg.kind == SegmentKind.DEVICE:
                return self.devices[seg.device].backend
        return dev.backend

    def plan_copies(self, owner: Any, rid: int, dst: np.ndarray, src: np.ndarray, size: np.ndarray) -> Op:
        """Copies validated with NumPy, contiguous runs merged, executed in order."""
        n = len(size)
        if n == 0:
            return Op(rid, [], [], self.devices[0], 0, lambda: None)
        table = self.table
        dsid, doff, dsegs = table.translate_many(dst, size, owner)
        ssid, soff, ssegs = table.translate_many(src, size, owner)
        segs = {**dsegs, **ssegs}
        if any(seg.kind == SegmentKind.REMOTE for seg in segs.values()):
            return plan_remote_copies(self, owner, rid, dsid, doff, ssid, soff, size, dsegs, ssegs)
        total = int(size.sum(dtype=np.uint64))
        dev = self._device_of(segs.values(), total)
        # Hazard ranges: per segment, the hull of what is read / written (conservative).
        reads = hulls(ssid, soff, size)
        writes = hulls(dsid, doff, size)
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

        return Op(rid, reads, writes, dev, total, run, host_only=all(seg.kind == SegmentKind.HOST for seg in segs.values()))


    def _plan_compute(self, owner: Any, req: P.Compute) -> Op | list[Op]:
        op = OPERATORS.get(req.op)
        if op is None:
            raise E.UnknownOperation(f"unknown operator {req.op!r}; known: {', '.join(sorted(OPERATORS))}")
        if len(req.inputs) != op.n_inputs or len(req.outputs) != op.n_outputs:
            raise E.InvalidField(f"{req.op} takes {op.n_inputs} input(s) and {op.n_outputs} output(s)")
        op.check(req.inputs, req.outputs, req.params)
        placed: list[tuple[TensorRef, Any, int, int]] = []
        pulls: list[Op] = []
        work = nbytes = 0
        all_host = True
        translate = self.table.translate
        for k, t in enumerate((*req.inputs, *req.outputs)):
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
            if seg.kind == SegmentKind.REMOTE and k < op.n_inputs:
                # A remote input is pulled first (one NIXL READ into a staging buffer); the
                # staging buffer's synthetic segment makes the compute wait for the pull.
                pull, seg, off = pull_input(self, owner, seg, off, extent)
                pulls.append(pull)
            elif seg.kind == SegmentKind.REMOTE:
                raise E.InvalidField("compute cannot write a remote segment: write a daemon buffer, then copy it out")
            placed.append((t, seg, off, extent))
            nbytes += extent
            all_host = all_host and seg.kind == SegmentKind.HOST
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
        dev = self._device_of([seg for _, seg, _, _ in placed], nbytes, req.device, req.placement, work)
        # The kernel by dtype signature; a light operator the device has no kernel for may run
        # on a device of the registry's fallback kind, when its operands are all host memory.
        host_only = req.device == -1 and all_host
        kind, kernel = REGISTRY.select(req.op, signature(req.inputs, req.outputs), dev.kind,
                                       {d.kind for d in self.devices} if host_only else ())
        if kind != dev.kind:
            dev = min((d for d in self.devices if d.kind == kind), key=lambda d: (d.queued_bytes, d.index))
        backend, params = dev.backend, req.params
        ins = [(t, self._span(seg, off, ext)) for t, seg, off, ext in placed[:n_in]]
        outs = [(t, self._span(seg, off, ext)) for t, seg, off, ext in placed[n_in:]]
        if not pulls:
            return Op(req.id, reads, writes, dev, nbytes, lambda: backend.compute(kernel, ins, outs, params, dev.local_id), work=work)

        def run() -> Any:
            try:
                for pull in pulls:
                    if pull.error is not None:
                        raise pull.error  # the input never arrived: this request fails with the reason
                return backend.compute(kernel, ins, outs, params, dev.local_id)
            finally:
                for pull in pulls:
                    self.remote.release_staging(pull.info)

        return [*pulls, Op(req.id, reads, writes, dev, nbytes, run, work=work)]

    def _plan_graph(self, owner: Any, req: P.RunGraph) -> list[Op]:
        """A graph run: each node planned as the compute request it is (`_plan_compute`:
        translation, checks, kernel by dtype, placement), then one op that answers.

        The nodes' ops have no request id of their own; each runs only if the nodes it
        reads succeeded, and the answering op, ordered after all of them by its hazard
        ranges, reports the first failure or (with `profile`) each node's device, kernel
        and time.
        """
        seg = self.table.lookup(req.graph, owner)
        graph: GraphSpec | None = seg.info.get("graph")
        if graph is None or req.graph != seg.va:
            raise E.InvalidField(f"RunGraph: {req.graph:#x} is not a graph's VA (define the graph first)")
        if len(req.inputs) != len(graph.inputs) or len(req.outputs) != len(graph.outputs):
            raise E.InvalidField(
                f"RunGraph: the graph takes {len(graph.inputs)} input and {len(graph.outputs)} output VA(s), "
                f"got {len(req.inputs)} and {len(req.outputs)}"
            )
        site = seg.info.get("site", "")
        refs = {n: graph.bind(n, va) for n, va in (*zip(graph.inputs, req.inputs), *zip(graph.outputs, req.outputs))}
        for n, off in graph.offsets.items():
            refs[n] = graph.bind(n, seg.va + off)
        ops: list[Op] = []
        nodes: list[Op] = []
        times = [0.0] * len(graph.nodes)
        for i, node in enumerate(graph.nodes):
            compute = P.Compute(0, node.op, [refs.get(n) or graph.tensors[n] for n in node.inputs],
                                [refs.get(n) or graph.tensors[n] for n in node.outputs], node.params,
                                node.device if node.device != -1 else graph.device,
                                node.placement or graph.placement, req.stream)
            try:
                planned = self._plan_compute(owner, compute)
            except E.TransferError as exc:
                raise type(exc)(f"graph{' created at ' + site if site else ''}, node {i} ({node.op}): {exc.message}") from None
            op = planned[-1] if isinstance(planned, list) else planned
            op.run = _guarded(op.run, [nodes[j] for j in graph.deps[i]], times, i, node.op)
            ops.extend(planned if isinstance(planned, list) else (planned,))
            nodes.append(op)
        done = [r for op in nodes for r in op.writes]

        def answer() -> Any:
            for op in nodes:
                if op.error is not None:
                    raise op.error
            if not req.profile:
                return None
            return {"nodes": [
                {"node": i, "op": graph.nodes[i].op, "device": op.device.index, "kind": op.device.kind,
                 "kernel": _signature_text(graph, graph.nodes[i]), "us": round(times[i] * 1e6, 1)}
                for i, op in enumerate(nodes)
            ]}

        ops.append(Op(req.id, done, [], nodes[-1].device, 0, answer))
        return ops


def _signature_text(graph: GraphSpec, node: Any) -> str:
    """What a profile says of a node's kernel: its dtype signature (the graph's dtypes, which
    every run binds alike; written only when a profile is asked for)."""
    ins = ", ".join(graph.tensors[n].dtype for n in node.inputs)
    outs = ", ".join(graph.tensors[n].dtype for n in node.outputs)
    return f"({ins}) -> ({outs})"


def _guarded(run: Any, deps: list[Op], times: list[float], i: int, name: str) -> Any:
    """A graph node's work: skipped with its producer's error if one failed, timed, and its
    own error named by node."""

    def node() -> Any:
        for dep in deps:
            if dep.error is not None:
                raise dep.error
        t0 = time.perf_counter()
        try:
            return run()
        except E.TransferError as exc:
            raise type(exc)(f"graph node {i} ({name}): {exc.message}") from None
        finally:
            times[i] = time.perf_counter() - t0

    return node



def plan_batch(planner: Planner, owner: Any, items: Sequence[tuple[Any, int]]) -> tuple[list[Op], list[Refusal]]:
    """Plan a pass's data requests, (request, route) pairs in arrival order.

    Returns the ops in arrival order and the refused requests. Runs of plain
    copies (socket Copy requests in a row, or a ring's CopyRun) are planned as
    one vector op validated with NumPy; if any copy in a run is invalid, the
    run is planned one by one so that only that copy fails.
    """
    ops: list[Op] = []
    refused: list[Refusal] = []

    def one(req: P.Request, route: int) -> None:
        try:
            planned = planner.plan(owner, req)
        except E.TransferError as exc:
            refused.append((req.id, route, exc))
            return
        except Exception as exc:  # a bug: fail this request, keep serving
            refused.append((req.id, route, E.InternalError(f"{type(exc).__name__}: {exc}")))
            return
        lane = lane_of(owner, req.stream)  # type: ignore[attr-defined]  # every data request has one
        for op in planned if isinstance(planned, list) else (planned,):
            if op.rid:
                op.route = route
            op.lane = lane
            ops.append(op)

    def vector(ids: Any, dst: np.ndarray, src: np.ndarray, size: np.ndarray, route: int, stream: int) -> bool:
        try:
            op = planner.plan_copies(owner, int(ids[0]), dst, src, size)
        except E.TransferError:
            return False  # one of them is bad: the caller plans them one by one
        op.kind, op.ids, op.route, op.lane = "copy", ids, route, lane_of(owner, stream)
        ops.append(op)
        return True

    run: list[P.Copy] = []
    run_route = SOCKET

    def flush() -> None:
        n = len(run)
        if n >= VECTOR_RUN and vector(
            [r.id for r in run],
            np.fromiter((r.dst for r in run), np.uint64, n),
            np.fromiter((r.src for r in run), np.uint64, n),
            np.fromiter((r.nbytes for r in run), np.uint64, n),
            run_route,
            run[0].stream,
        ):
            run.clear()
            return
        for r in run:
            one(r, run_route)
        run.clear()

    for req, route in items:
        if type(req) is P.Copy:
            if run and (route != run_route or req.stream != run[0].stream):
                flush()
            run.append(req)
            run_route = route
            continue
        if run:
            flush()
        if type(req) is CopyRun:
            if not vector(req.ids, req.dst, req.src, req.nbytes, route, req.stream):
                for r in req.singles():
                    one(r, route)
        else:
            one(req, route)
    if run:
        flush()
    return ops, refused
