"""A defined graph as its runs use it: what the definition fixed, laid out once.

`GraphSpec` (kernels/_graph.py, pure) names each node's operands as intermediates
or externals. Here they become *slots* of one table per run: the externals
first (the run's inputs and outputs, and the weights: translated by each run,
since a run's VAs are new and a weight may have been freed since), then the
intermediates, whose spans and hazard ranges in the graph's own segment are
fixed for that segment's life and made once, when the graph is defined
(`server/_deferred.define_graph`). A run fills in the externals' slots and
places each node from its slots (`_graphrun.plan_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Callable, Sequence

from ..addressing import OFFSET_BITS, Segment
from ..backends import Span
from ..kernels import OPERATORS, GraphSpec, TensorRef
from ._ops import Range

__all__ = ["GraphPlan", "NodePlan"]


@dataclass(frozen=True, slots=True)
class NodePlan:
    """One node: its operator, its operands' slots (inputs then outputs) and what placement needs."""

    op: str
    in_place: bool
    params: Any
    n_inputs: int
    refs: tuple[TensorRef, ...]
    slots: tuple[int, ...]
    signature: tuple[str, ...]
    nbytes: int
    work: int
    device: int
    placement: str
    deps: tuple[int, ...]
    #: slot table -> this node's entries, as a tuple (`operator.itemgetter` over `slots`)
    gather: Callable[[Sequence[Any]], tuple[Any, ...]]


def _gather(slots: tuple[int, ...]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """A tuple of the entries at `slots` (itemgetter returns a bare entry for one slot)."""
    if len(slots) == 1:
        (k,) = slots
        return lambda table: (table[k],)
    return itemgetter(*slots)


class GraphPlan:
    """The graph's nodes and the slot table's fixed part (its intermediates)."""

    __slots__ = ("spec", "site", "n_slots", "spans", "ranges", "nodes", "binding", "bound_slots", "weight_groups")

    def __init__(self, spec: GraphSpec, seg: Segment[Any], site: str) -> None:
        self.spec, self.site = spec, site
        n_ext = len(spec.externals)
        blocks = dict.fromkeys(spec.offsets.values())  # (names that share memory share a slot)
        slot_of = {off: n_ext + k for k, off in enumerate(blocks)}
        self.n_slots = (n_ext, len(slot_of))
        #: Per slot: span and hazard range (None for the externals, which each run fills). The
        #: segment itself is not kept: its info holds this plan, and a cycle would keep its
        #: memory until the cyclic collector ran.
        self.spans: list[Any] = [None] * n_ext
        self.ranges: list[Any] = [None] * n_ext
        extent = dict.fromkeys(blocks, 0)
        for lay in spec.layout:
            for ext, off, _, nbytes in lay.operands:
                if ext < 0:
                    extent[off] = nbytes
        for off in blocks:
            self.spans.append(Span(seg.kind, seg.handle, off, extent[off]))
            self.ranges.append((seg.id, off, off + extent[off]))
        nodes = []
        for node, lay, deps in zip(spec.nodes, spec.layout, spec.deps):
            slots = tuple(ext if ext >= 0 else slot_of[off] for ext, off, _, _ in lay.operands)
            nodes.append(NodePlan(
                node.op, OPERATORS[node.op].in_place, node.params, lay.n_inputs,
                tuple(t for _, _, t, _ in lay.operands), slots, lay.signature, lay.nbytes, lay.work,
                node.device if node.device != -1 else spec.device, node.placement or spec.placement, deps,
                _gather(slots),
            ))
        self.nodes: tuple[NodePlan, ...] = tuple(nodes)
        # The externals a run binds: external index -> position in the run's VAs (inputs,
        # then outputs); and the weights, grouped by the segment they name:
        # (lowest VA, bytes to the end of the highest, their external indices).
        position = {n: k for k, n in enumerate((*spec.inputs, *spec.outputs))}
        self.binding: dict[int, int] = {e: position[x.name] for e, x in enumerate(spec.externals) if not x.va}
        self.bound_slots: tuple[tuple[int, int], ...] = tuple(self.binding.items())
        groups: dict[int, list[int]] = {}
        for e, x in enumerate(spec.externals):
            if x.va:
                groups.setdefault(x.va >> OFFSET_BITS, []).append(e)
        self.weight_groups: tuple[tuple[int, int, tuple[int, ...]], ...] = tuple(
            (lo, max(spec.externals[e].va + spec.externals[e].extent for e in members) - lo, tuple(members))
            for members in groups.values()
            for lo in (min(spec.externals[e].va for e in members),)
        )

    def table(self, seg: Segment[Any]) -> tuple[list[Any], list[Span | None], list[Range | None]]:
        """A run's slot table (segments, spans, ranges; `seg`: the graph's), its externals
        still to fill in."""
        n_ext, n_mid = self.n_slots
        return [None] * n_ext + [seg] * n_mid, self.spans[:], self.ranges[:]
