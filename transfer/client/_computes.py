"""Repeated computes as one-node graphs, defined once.

A `compute` is a socket request the daemon plans on its event loop every time. A compute a
producer repeats (the same operator, parameters, dtypes and shapes; other VAs are fine) is
worth a graph: defined once, it runs as one ring descriptor (one input and one output), and
the daemon keeps its plan, so its ring worker runs it on its own thread (server/_inline.py).
`ComputeGraphs` makes that graph at a compute's second call and reuses it from then on; the
first call goes as it is, so a mistake is reported as a compute's. It keeps at most
`KEPT` graphs, each with an id of the session's arena (`--arena-ids`): the least recently
used goes (freed on the daemon) when a new one would exceed that.

Not made into a graph: a compute that answers a value (no outputs: `checksum`), names
strided tensors, or has parameters that do not hash; a session without deferred creation;
a graph the client's own check refuses or the arena has no id for (that compute then keeps
going as a compute).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

from .. import errors as E
from ..kernels import TensorRef
from ._deferred import DeferredState, Graph

__all__ = ["ComputeGraphs", "KEPT"]

#: One-node graphs a session keeps.
KEPT = 64

#: A key seen once: the next call with it makes the graph.
_SEEN = object()


class ComputeGraphs:
    """A session's one-node graphs by (operator, parameters, operand dtypes and shapes,
    device, placement). Call under the session's lock."""

    def __init__(self) -> None:
        self._graphs: OrderedDict[Any, Any] = OrderedDict()

    def graph(self, state: DeferredState | None, op: Any, ins: Sequence[TensorRef], outs: Sequence[TensorRef],
              params: dict[str, Any], device: int, placement: str) -> Graph | None:
        """The graph to run this compute as, or None (send it as a compute)."""
        if state is None or not outs or type(op) is not str:
            return None
        try:
            key = (op, tuple(sorted(params.items())), _shapes(ins), _shapes(outs), device, placement)
            got = self._graphs.get(key)
        except TypeError:  # unhashable parameters, or a strided tensor (_shapes)
            return None
        if isinstance(got, Graph):
            self._graphs.move_to_end(key)
            return got
        if got is None and key in self._graphs:
            return None  # refused before: it stays a compute
        if got is None:
            self._remember(state, key, _SEEN)
            return None
        graph = Graph(device=device, placement=placement)
        try:
            names_in = [graph.input(f"i{k}", t.shape, t.dtype) for k, t in enumerate(ins)]
            names_out = [graph.output(f"o{k}", t.shape, t.dtype) for k, t in enumerate(outs)]
            graph.op(op, names_in, names_out, params)
            graph.prepare(state)
        except E.TransferError:
            self._remember(state, key, None)
            return None
        self._remember(state, key, graph)
        return graph

    def _remember(self, state: DeferredState, key: Any, value: Any) -> None:
        graphs = self._graphs
        graphs[key] = value
        graphs.move_to_end(key)
        while len(graphs) > KEPT:
            _, old = graphs.popitem(last=False)
            if isinstance(old, Graph) and old.memory is not None and not old.memory.freed:
                state.free(old.memory)


def _shapes(refs: Sequence[TensorRef]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out = []
    for t in refs:
        if t.strides is not None:
            raise TypeError("strided")
        out.append((t.dtype, tuple(t.shape)))
    return tuple(out)
