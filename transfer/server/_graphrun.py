"""A graph run planned: its definition's layout (`_graphplan.GraphPlan`) bound to the run's
VAs, each node placed as the compute request it is, consecutive nodes on one device as one op.

The planner calls `plan_graph` for a RunGraph. The externals (the run's inputs and outputs,
the weights) are translated once each; shapes, dtypes and parameters were checked when the
graph was defined. A run's ops share one `_GraphRun`: each node's error and time, and the
answer the last op gives (the first failure in node order, or the profile).

A run is planned once per (graph, session, bound VAs): its nodes' placements are kept by the
planner (`Planner.graph_runs`), and a later run with the same VAs reuses them, translating and
placing nothing ("graph_plans_reused"), as long as no segment has gone and no session has
lost a segment it was a guest of: any free or detach anywhere clears what was kept
(`MappingTable.on_change`), so a freed operand is translated again, and refused, and no kept
plan holds freed memory. Only placements that load does not decide are kept. A kept run of
one input and one output whose nodes all run on one device is also bound for the session's
ring worker to run itself (`_inline`), where the device's backend can.
"""

from __future__ import annotations

from typing import Any, Sequence

from .. import _results as R
from .. import errors as E
from .. import protocol as P
from ..addressing import SegmentKind
from ..backends import Answer, Span, Then
from ..kernels import FAILED, SKIPPED
from ._graphplan import GraphPlan, NodePlan
from ._ops import Op, Range
from ._placement import VirtualDevice

__all__ = ["plan_graph", "RUNS_KEPT"]

#: Graph runs' placements the planner keeps (producers cycling through slots, graphs, sessions).
RUNS_KEPT = 1024


def plan_graph(planner: Any, owner: Any, req: P.RunGraph) -> list[Op]:
    """A graph run, planned with what its definition laid out (`GraphPlan`): the VAs
    outside the graph's memory (the run's inputs and outputs, the weights) are translated
    once each (bounds, ownership: a freed weight fails here), then each node is placed
    as the compute request it is (`Planner.place`: the overlap rule, the placement rule, the
    kernel by dtype). Shapes, dtypes and parameters were checked when the graph was
    defined, and a run binds only VAs, so they are not checked again.

    Consecutive nodes on one device are ONE op: a worker runs the whole stretch in one
    call, with no wave, unit or thread hop per node. A graph whose nodes go to several
    devices is one op per stretch, ordered by their hazard ranges. The last op answers:
    the first failing node's error (a node whose input failed is skipped with that
    error), or with `profile` each node's device, kernel and time.
    """
    gseg = planner.table.lookup(req.graph, owner)
    plan: GraphPlan | None = gseg.info.get("graph")
    if plan is None or req.graph != gseg.va:
        raise E.InvalidField(f"RunGraph: {req.graph:#x} is not a graph's VA (define the graph first)")
    graph = plan.spec
    if len(req.inputs) != len(graph.inputs) or len(req.outputs) != len(graph.outputs):
        raise E.InvalidField(
            f"RunGraph: the graph takes {len(graph.inputs)} input and {len(graph.outputs)} output VA(s), "
            f"got {len(req.inputs)} and {len(req.outputs)}"
        )
    key: tuple[Any, ...] | None = (gseg.id, owner, *req.inputs, *req.outputs)
    kept = planner.graph_runs
    placed = kept.get(key)
    pulls: list[Op] = []
    if placed is not None:
        if planner.counters:
            planner.counters["graph_plans_reused"] += 1
    else:
        placed, fixed = _place(planner, owner, plan, gseg, req, pulls)
        if fixed and not pulls:  # (remote inputs are pulled afresh each run)
            if len(kept) >= RUNS_KEPT:
                kept.clear()
            kept[key] = placed
        else:
            key = None
    run = _GraphRun(plan, req.profile, pulls, planner if pulls else None)
    ops: list[Op] = []
    current: _Stretch | None = None
    for i, dev, kernel, ins, outs, nranges in placed:
        node = plan.nodes[i]
        if current is None or dev is not current.device:
            current = _Stretch(run, dev)
            ops.append(current.op)
        current.add(i, kernel, ins, outs, node, nranges)
    for op in ops[:-1]:  # the last, which answers, waits for every other
        ops[-1].reads.extend(op.writes)
    if len(ops) == 1 and not pulls and ops[0].device.backend.out_of_process:
        # (one stretch: a later one's start would depend on what failed before it)
        ops[0].begin = current.begin  # type: ignore[union-attr]
    ops[-1].rid = req.id
    run.ops = ops
    if key is not None and len(ops) == 1 and len(req.inputs) == len(req.outputs) == 1:
        _bind(planner, owner, req, ops[0], current.steps)  # type: ignore[union-attr]
    return [*pulls, *ops]


def _bind(planner: Any, owner: Any, req: P.RunGraph, op: Op, steps: list[Any]) -> None:
    """A kept run of one stretch, bound for the ring's worker to run itself (`_inline`), where
    its device's backend can; on a GPU its device work holds every segment it touches."""
    inline, device = planner.inline, op.device
    at = (owner, req.graph, req.inputs[0], req.outputs[0])
    if at not in inline.kept:
        bound = device.backend.inline_steps(steps, device.local_id, planner.counters)
        if bound is not None:
            holds = tuple(sorted({r[0] for r in (*op.reads, *op.writes)})) if device.kind == "gpu" else ()
            inline.keep(*at, bound, holds)


def _place(planner: Any, owner: Any, plan: GraphPlan, gseg: Any, req: P.RunGraph, pulls: list[Op]) -> tuple[list[Any], bool]:
    """Each node's (index, device, kernel, input and output (ref, span)s, hazard ranges), and
    whether every node's device is fixed (not chosen by load: then the placement may be kept)."""
    segs, spans, ranges = plan.table(gseg)
    bind_externals(planner, owner, plan, (*req.inputs, *req.outputs), segs, spans, ranges, pulls)
    placed = []
    fixed = True
    for i, node in enumerate(plan.nodes):
        gather = node.gather
        nranges = gather(ranges)
        try:
            dev, kernel, ins, outs = planner.place(
                node.op, node.in_place, node.n_inputs, node.signature, node.refs, gather(segs),
                gather(spans), nranges, node.nbytes, node.work, node.device, node.placement)
        except E.TransferError as exc:
            raise _at_node(exc, plan, i) from None
        placed.append((i, dev, kernel, ins, outs, nranges))
        fixed = fixed and planner.fixed_placement(gather(segs), node.nbytes, node.device, node.placement, node.work, dev)
    return placed, fixed



def bind_externals(planner: Any, owner: Any, plan: GraphPlan, vas: tuple[int, ...], segs: list[Any], spans: list[Any],
                   ranges: list[Any], pulls: list[Op]) -> None:
    """Fill a run's slots of the memory outside the graph: each bound VA translated, and
    the weights one translation per segment they share (the hull of their ranges lies in
    the segment exactly when each of them does). Where anything fails (or is remote),
    every external is translated alone, in the order the nodes first use them, so the
    error names the node that names the first bad VA, as one request per node would."""
    translate = planner.table.translate
    externals = plan.spec.externals

    def put(e: int, seg: Any, off: int) -> None:
        n = externals[e].extent
        segs[e] = seg
        spans[e] = Span(seg.kind, seg.handle, off, n)
        ranges[e] = (seg.id, off, off + n)

    try:
        for lo, n, members in plan.weight_groups:
            seg, base = translate(lo, n, owner)
            if seg.kind == SegmentKind.REMOTE:
                raise _Alone()
            for e in members:
                put(e, seg, base + externals[e].va - lo)
        for e, k in plan.bound_slots:
            seg, off = translate(vas[k], externals[e].extent, owner)
            if seg.kind == SegmentKind.REMOTE:
                raise _Alone()
            put(e, seg, off)
        return
    except (E.TransferError, _Alone):
        pass
    for e, ext in enumerate(externals):
        try:
            seg, off = translate(ext.va or vas[plan.binding[e]], ext.extent, owner)
            if seg.kind == SegmentKind.REMOTE:
                seg, off = planner.pull(owner, seg, off, ext.extent, not ext.written, pulls)
        except E.TransferError as exc:
            raise _at_node(exc, plan, ext.first) from None
        put(e, seg, off)


class _Alone(Exception):
    """A run's externals are translated one by one instead (a failure, or remote memory)."""


def _at_node(exc: E.TransferError, plan: GraphPlan, i: int) -> E.TransferError:
    """A planning error of a graph's node i, naming the graph's creation site and the node."""
    site = plan.site
    return type(exc)(f"graph{' created at ' + site if site else ''}, node {i} ({plan.nodes[i].op}): {exc.message}")


class _GraphRun:
    """One run of a graph: its nodes' errors and times, shared by its stretches (ops)."""

    __slots__ = ("graph", "profile", "pulls", "planner", "errors", "times", "ops")

    def __init__(self, plan: GraphPlan, profile: bool, pulls: list[Op], planner: Any) -> None:
        self.graph, self.profile, self.pulls, self.planner = plan.spec, profile, pulls, planner
        n = len(plan.nodes)
        self.errors: list[E.TransferError | None] = [None] * n
        self.times = [0.0] * n
        self.ops: list[Op] = []

    def answer(self) -> Any:
        """The last stretch's end: the first failure in node order, or the profile."""
        errors = self.errors
        for op in self.ops[:-1]:  # a stretch the device failed under (its synchronize)
            if op.error is not None:
                raise op.error
        for err in errors:
            if err is not None:
                raise err
        if not self.profile:
            return None
        graph, times, ops = self.graph, self.times, self.ops
        device = {i: op.device for op in ops for i in op.info}
        return R.GraphProfile([
            R.NodeProfile(i, node.op, device[i].index, device[i].kind, graph.layout[i].signature_text, round(times[i] * 1e6, 1))
            for i, node in enumerate(graph.nodes)
        ])


class _Stretch:
    """Consecutive nodes of a graph run on one device: one op that runs them in order."""

    __slots__ = ("run", "device", "op", "steps")

    def __init__(self, run: _GraphRun, device: VirtualDevice) -> None:
        self.run, self.device = run, device
        self.steps: list[tuple[int, Any, list[Any], list[Any], Any, tuple[int, ...], str]] = []
        self.op = Op(0, [], [], device, 0, self.execute)
        self.op.info = []  # the node indices it runs (what a profile reports per node)

    def add(self, i: int, kernel: Any, ins: list[Any], outs: list[Any], node: NodePlan, ranges: Sequence[Range]) -> None:
        op = self.op
        self.steps.append((i, kernel, ins, outs, node.params, node.deps, node.op))
        op.info.append(i)
        op.reads.extend(ranges[:node.n_inputs])
        op.writes.extend(ranges[node.n_inputs:])
        op.nbytes += node.nbytes
        op.work += node.work

    def execute(self) -> Any:
        """A worker's (or the loop's) share: each node, skipped with its producer's error if
        one failed, timed, and its own error named by node (`kernels.run_steps`, in the
        device's process on a CPU). The last stretch answers."""
        run = self.run
        try:
            for pull in run.pulls:
                if pull.error is not None:
                    raise pull.error  # an input never arrived: the run fails with the reason
            return self.begin()()
        finally:
            if self.op is run.ops[-1] and run.planner is not None:
                run.planner.release_pulls(run.pulls)

    def begin(self, block: bool = True) -> Then:
        """Start the nodes on the device; the answer is the run's, once they have run."""
        run = self.run
        errors = run.errors
        failed = {j for j, err in enumerate(errors) if err is not None}

        def end(outcomes: list[tuple[int, Any, float]]) -> Any:
            times = run.times
            for step, (state, value, seconds) in zip(self.steps, outcomes):
                i = step[0]
                times[i] = seconds
                errors[i] = value if state == FAILED else errors[value] if state == SKIPPED else None
            return run.answer() if self.op is run.ops[-1] else None

        answer: Answer | Then = self.device.backend.begin_steps(self.steps, failed, self.device.local_id, block)
        return answer.then(end)
