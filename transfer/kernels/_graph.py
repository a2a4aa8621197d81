"""Computation graphs: operators over named tensors, checked and laid out once.

Pure (no devices, no sessions): the daemon parses every graph definition from
the wire with `parse_graph`, and the client runs the same function before it
sends one, so both agree on the graph's memory (`GraphSpec.scratch_nbytes`)
and a mistake is reported where it was made. A graph is in SSA form: every
tensor is written by at most one node, so a cycle is a tensor read before
(or by) the node that writes it, and the node order is a topological order.

Tensors have four roles, given by where their memory comes from:

* inputs and outputs: bound to VAs by each run (contiguous);
* weights: a VA fixed by the definition (a device buffer, usually);
* intermediates: everything else; the daemon lays them out in one block of
  its own memory (`offsets`), which the client never addresses.

`parse_graph` also lays out each node's operands once (`GraphSpec.layout`,
`GraphSpec.externals`): which are intermediates (an offset in that block) and
which name memory outside it (an input or output bound by each run, or a
weight), in the order the nodes first use them. A run then only translates
the outside VAs and executes (server/_planner.py, `Planner._plan_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .. import errors as E
from ._registry import OPERATORS
from ._tensors import DTYPES, MAX_DIMS, TensorRef, tensor_nbytes

__all__ = ["GraphSpec", "GraphNode", "NodeLayout", "External", "parse_graph", "graph_wire", "MAX_GRAPH_NODES", "MAX_GRAPH_TENSORS", "GRAPH_ALIGN"]

#: Limits of one graph definition (docs/protocol.md): nodes, named tensors.
MAX_GRAPH_NODES = 256
MAX_GRAPH_TENSORS = 512
#: Each intermediate starts at a multiple of this (a GPU kernel's operands must be aligned).
GRAPH_ALIGN = 256
_MAX_NAME = 64
_MAX_TENSOR_BYTES = 1 << 40


@dataclass(frozen=True, slots=True)
class GraphNode:
    """One operator of the graph: names in, names out, its parameters and placement overrides."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    params: dict[str, Any]
    device: int = -1
    placement: str = ""


@dataclass(frozen=True, slots=True)
class External:
    """A tensor a node names outside the graph's own memory: a graph input or output (its VA
    bound by each run: `va` 0) or a weight (`va` fixed by the definition)."""

    name: str
    va: int
    #: Bytes from its VA the tensor touches (graph tensors are C-contiguous: its element bytes).
    extent: int
    #: The first node that names it (what an error about it names), and whether the graph writes it.
    first: int
    written: bool


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Where a node's operands live, inputs then outputs, fixed by the definition.

    Each operand is (external index, intermediate offset, ref, extent): an index into
    `GraphSpec.externals`, or -1 and its byte offset in the graph's memory. `ref` has the
    graph's dtype and shape (its VA is not used: memory is named by the run's spans)."""

    operands: tuple[tuple[int, int, TensorRef, int], ...]
    n_inputs: int
    #: The dtype signature (the kernel is chosen by it), and as a profile writes it.
    signature: tuple[str, ...]
    signature_text: str
    #: Bytes the operands span, and the element work (a compute request's `nbytes` and `work`).
    nbytes: int
    work: int


@dataclass(frozen=True)
class GraphSpec:
    """A checked graph: tensors by name, nodes in a topological order, the intermediates' layout."""

    tensors: dict[str, TensorRef]  # name -> ref; va 0 for bound and intermediate tensors
    nodes: tuple[GraphNode, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    device: int
    placement: str
    #: intermediate name -> byte offset in the graph's memory (an in-place node's input may
    #: share its output's: `_shared_in_place`)
    offsets: dict[str, int]
    scratch_nbytes: int
    #: node index -> indices of the nodes whose outputs it reads
    deps: tuple[tuple[int, ...], ...]
    #: Tensors outside the graph's memory that some node names, in order of first use.
    externals: tuple[External, ...] = ()
    #: node index -> where its operands live
    layout: tuple[NodeLayout, ...] = ()

    def param_bytes(self) -> int:
        """Bytes of the weights: what `size` placement calls the graph's parameter size."""
        roles = set(self.inputs) | set(self.outputs) | set(self.offsets)
        return sum(tensor_nbytes(t) for n, t in self.tensors.items() if n not in roles)

    def bind(self, name: str, va: int) -> TensorRef:
        t = self.tensors[name]
        return TensorRef(va, t.dtype, t.shape, t.strides)


def _name(v: Any, where: str) -> str:
    if type(v) is not str or not 0 < len(v) <= _MAX_NAME:
        raise E.InvalidField(f"{where}: a tensor name is a string of 1 to {_MAX_NAME} characters, got {v!r}")
    return v


def _names(v: Any, where: str, limit: int) -> tuple[str, ...]:
    if type(v) is not list or len(v) > limit:
        raise E.InvalidField(f"{where}: expected a list of at most {limit} tensor names")
    return tuple(_name(x, f"{where}[{k}]") for k, x in enumerate(v))


def _int(v: Any, where: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise E.InvalidField(f"{where}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _tensor(v: Any, where: str) -> tuple[str, TensorRef]:
    if type(v) is not list or len(v) != 4:
        raise E.InvalidField(f"{where}: a graph tensor is [name, dtype, shape, va|nil]")
    name, dtype, shape, va = v
    name = _name(name, f"{where}.name")
    if type(dtype) is not str or dtype not in DTYPES:
        raise E.InvalidField(f"{where} ({name}).dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    if type(shape) is not list or len(shape) > MAX_DIMS:
        raise E.InvalidField(f"{where} ({name}).shape: expected a list of at most {MAX_DIMS} sizes")
    dims = tuple(_int(d, f"{where} ({name}).shape", 0, _MAX_TENSOR_BYTES) for d in shape)
    ref = TensorRef(0 if va is None else _int(va, f"{where} ({name}).va", 1, (1 << 64) - 1), dtype, dims)
    if tensor_nbytes(ref) > _MAX_TENSOR_BYTES:
        raise E.InvalidField(f"{where} ({name}): more than {_MAX_TENSOR_BYTES} bytes of elements")
    return name, ref


def parse_graph(d: Any, where: str = "graph") -> GraphSpec:
    """A wire definition `[tensors, nodes, inputs, outputs, device, placement]`, checked.

    Refuses (InvalidField / UnknownOperation, naming the node and tensor): unknown or
    duplicate names, a tensor written twice, a cycle (a read before the write), an
    intermediate nobody writes, operator arity, shapes, dtypes and parameters
    (`Operator.check`, the same check a single compute request gets).
    """
    if type(d) is not list or len(d) != 6:
        raise E.InvalidField(f"{where}: a graph is [tensors, nodes, inputs, outputs, device, placement]")
    raw_tensors, raw_nodes, raw_in, raw_out, device, placement = d
    if type(raw_tensors) is not list or len(raw_tensors) > MAX_GRAPH_TENSORS:
        raise E.InvalidField(f"{where}.tensors: expected a list of at most {MAX_GRAPH_TENSORS} tensors")
    if type(raw_nodes) is not list or not 0 < len(raw_nodes) <= MAX_GRAPH_NODES:
        raise E.InvalidField(f"{where}.nodes: expected a list of 1 to {MAX_GRAPH_NODES} nodes")
    device = _int(device, f"{where}.device", -1, (1 << 31) - 1)
    if type(placement) is not str or len(placement) > 32:
        raise E.InvalidField(f"{where}.placement: a policy name of at most 32 characters")
    tensors: dict[str, TensorRef] = {}
    for k, t in enumerate(raw_tensors):
        name, ref = _tensor(t, f"{where}.tensors[{k}]")
        if name in tensors:
            raise E.InvalidField(f"{where}: tensor {name!r} is declared twice")
        tensors[name] = ref
    inputs = _names(raw_in, f"{where}.inputs", 16)
    outputs = _names(raw_out, f"{where}.outputs", 16)
    if not inputs or not outputs:
        raise E.InvalidField(f"{where}: a graph has at least one input and one output")
    for role, names in (("input", inputs), ("output", outputs)):
        for n in names:
            if n not in tensors:
                raise E.InvalidField(f"{where}: {role} {n!r} is not a declared tensor")
            if tensors[n].va:
                raise E.InvalidField(f"{where}: {role} {n!r} has a VA; inputs and outputs are bound by each run")
    if len(set(inputs + outputs)) != len(inputs) + len(outputs):
        raise E.InvalidField(f"{where}: a tensor is named twice among the inputs and outputs")
    writer: dict[str, int] = {}
    nodes: list[GraphNode] = []
    deps: list[tuple[int, ...]] = []
    for i, raw in enumerate(raw_nodes):
        at = f"{where}.nodes[{i}]"
        if type(raw) is not list or len(raw) != 6:
            raise E.InvalidField(f"{at}: a node is [op, inputs, outputs, params, device, placement]")
        op_name, ins, outs, params, ndev, npl = raw
        if type(op_name) is not str or op_name not in OPERATORS:
            raise E.UnknownOperation(f"{at}: unknown operator {op_name!r}")
        at = f"{at} ({op_name})"
        op = OPERATORS[op_name]
        ins, outs = _names(ins, f"{at}.inputs", 16), _names(outs, f"{at}.outputs", 16)
        if type(params) is not dict:
            raise E.InvalidField(f"{at}.params: expected a map")
        ndev = _int(ndev, f"{at}.device", -1, (1 << 31) - 1)
        if type(npl) is not str or len(npl) > 32:
            raise E.InvalidField(f"{at}.placement: a policy name of at most 32 characters")
        if len(ins) != op.n_inputs or len(outs) != op.n_outputs:
            raise E.InvalidField(f"{at}: takes {op.n_inputs} input(s) and {op.n_outputs} output(s), got {len(ins)} and {len(outs)}")
        for n in (*ins, *outs):
            if n not in tensors:
                raise E.InvalidField(f"{at}: unknown tensor {n!r}")
        for n in outs:
            if n in writer:
                raise E.InvalidField(f"{at}: tensor {n!r} is already written by node {writer[n]} (each tensor has one writer)")
            if n in inputs or tensors[n].va:
                raise E.InvalidField(f"{at}: writes {n!r}, which is a graph input or a weight")
        for n in ins:
            if n in outs:
                raise E.InvalidField(f"{at}: reads and writes {n!r} (a cycle); write a new tensor")
        later = [n for n in ins if n not in writer and n not in inputs and not tensors[n].va]
        if later:
            raise E.InvalidField(
                f"{at}: reads {later[0]!r} before any node writes it "
                "(a cycle, or nodes out of order: list each node after the nodes it reads)"
            )
        try:
            op.check([tensors[n] for n in ins], [tensors[n] for n in outs], params)
        except E.TransferError as exc:
            raise type(exc)(f"{at}: {exc.message}") from None
        for n in outs:
            writer[n] = i
        deps.append(tuple(sorted({writer[n] for n in ins if n in writer})))
        nodes.append(GraphNode(op_name, ins, outs, params, ndev, npl))
    for n in outputs:
        if n not in writer:
            raise E.InvalidField(f"{where}: output {n!r} is written by no node")
    shared = _shared_in_place(tensors, nodes, outputs, writer)
    offsets: dict[str, int] = {}
    end = 0
    for n in writer:
        if n in outputs or n in shared:
            continue
        offsets[n] = end
        end += -(-max(tensor_nbytes(tensors[n]), 1) // GRAPH_ALIGN) * GRAPH_ALIGN
    for n, into in shared.items():
        offsets[n] = offsets[into]
    externals, layout = _lay_out(tensors, nodes, offsets, outputs)
    return GraphSpec(tensors, tuple(nodes), inputs, outputs, device, placement, offsets, max(end, GRAPH_ALIGN), tuple(deps),
                     externals, layout)


def _shared_in_place(tensors: dict[str, TensorRef], nodes: Sequence[GraphNode], outputs: Sequence[str],
                     writer: dict[str, int]) -> dict[str, str]:
    """Intermediates that share the memory of the intermediate an in-place node makes of them
    (name -> the last of the chain's names): the node's first input, read by no other node
    and by it once, with its output's dtype and shape, written by a node placed as it is. The
    writer then writes where the in-place node runs (a linear and the relu after it touch one
    block, not two: half the memory, twice the cache hits), and the values are the same.
    Graph outputs keep their own memory: what the run's VAs name is written as before."""
    readers: dict[str, list[int]] = {}
    for j, node in enumerate(nodes):
        for n in node.inputs:
            readers.setdefault(n, []).append(j)
    into: dict[str, str] = {}
    for j, node in enumerate(nodes):
        if not OPERATORS[node.op].in_place or len(node.outputs) != 1:
            continue
        t, u = node.inputs[0], node.outputs[0]
        src, dst = tensors[t], tensors[u]
        if (t in writer and t not in outputs and u not in outputs and readers[t] == [j]
                and (src.dtype, src.shape) == (dst.dtype, dst.shape)
                and (nodes[writer[t]].device, nodes[writer[t]].placement) == (node.device, node.placement)):
            into[t] = u
    for t, u in into.items():
        while u in into:
            u = into[u]
        into[t] = u
    return into


def _lay_out(tensors: dict[str, TensorRef], nodes: Sequence[GraphNode], offsets: dict[str, int],
             outputs: Sequence[str]) -> tuple[tuple[External, ...], tuple[NodeLayout, ...]]:
    """Each node's operands as intermediates (offsets) or externals (first use first)."""
    index: dict[str, int] = {}
    found: list[list[Any]] = []
    layout: list[NodeLayout] = []
    for i, node in enumerate(nodes):
        operands: list[tuple[int, int, TensorRef, int]] = []
        for k, n in enumerate((*node.inputs, *node.outputs)):
            t = tensors[n]
            nbytes = tensor_nbytes(t)  # contiguous: the extent is the element bytes
            if n in offsets:
                operands.append((-1, offsets[n], t, nbytes))
                continue
            if n not in index:
                index[n] = len(found)
                found.append([n, t.va, nbytes, i, n in outputs])
            operands.append((index[n], 0, t, nbytes))
        n_in = len(node.inputs)
        sig = tuple(t.dtype for _, _, t, _ in operands)
        text = f"({', '.join(sig[:n_in])}) -> ({', '.join(sig[n_in:])})"
        total = sum(e for _, _, _, e in operands)
        layout.append(NodeLayout(tuple(operands), n_in, sig, text, total, total))
    return tuple(External(*f) for f in found), tuple(layout)


def graph_wire(tensors: Sequence[tuple[str, str, Sequence[int], int | None]], nodes: Sequence[GraphNode],
               inputs: Sequence[str], outputs: Sequence[str], device: int = -1, placement: str = "") -> list[Any]:
    """The wire form `parse_graph` reads."""
    return [
        [[n, dt, list(shape), va] for n, dt, shape, va in tensors],
        [[nd.op, list(nd.inputs), list(nd.outputs), nd.params, nd.device, nd.placement] for nd in nodes],
        list(inputs), list(outputs), device, placement,
    ]
