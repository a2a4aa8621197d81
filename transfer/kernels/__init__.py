"""Operators, the kernel registry, and kernels by dtype (placement: server._placement).

A compute request names an operator and tensor references (VA, dtype, shape,
strides). The registry maps (operator, dtype signature, device kind) to a
kernel; a placement policy picks the virtual device. Kernels receive NumPy (or
CuPy) arrays that are *views* of already-checked memory; they never see a VA.

Placement rule (one rule, documented in docs/architecture.md): compute runs
on the device that holds its device-buffer operands. If they live on
different devices the request is refused. Only when every operand is host
(shared) memory does the placement policy choose a device
(`transfer.server._placement`); and only then may a GPU hand a light operator
whose dtypes it has no kernel for to a CPU device (`Registry.select`).

Modules: `_tensors` (dtypes, TensorRef), `_registry` (Operator, Kernel,
Registry), `_checks` (parameter checks), `_basic`, `_layers`, `_images` (the
operators and their kernels), `_graph` (graphs of operators, checked once), `_cuda` (CUDA sources compiled through CuPy).
docs/operators.md lists every operator, its signatures and tolerances.
"""

from __future__ import annotations

from . import _basic, _images, _layers  # noqa: F401  (registers the operators)
from ._registry import OPERATORS, REGISTRY, Kernel, Operator, Registry, Sig, signature
from ._steps import DONE, FAILED, SKIPPED, Step, run_steps, run_through
from ._layers import fuse_steps
from ._process import MAX_MESSAGE, process_argv
from ._graph import GRAPH_ALIGN, MAX_GRAPH_NODES, MAX_GRAPH_TENSORS, GraphNode, GraphSpec, graph_wire, parse_graph
from ._tensors import ALL, DTYPES, FLOATS, HALVES, INTS, MAX_DIMS, NUMERIC, TensorRef, acc_dtype, shape_tuple, storage_dtype, tensor_extent, tensor_nbytes

__all__ = [
    "MAX_MESSAGE",
    "process_argv",
    "run_steps",
    "run_through",
    "fuse_steps",
    "Step",
    "DONE",
    "FAILED",
    "SKIPPED",
    "DTYPES",
    "FLOATS",
    "HALVES",
    "INTS",
    "NUMERIC",
    "ALL",
    "MAX_DIMS",
    "TensorRef",
    "Kernel",
    "Operator",
    "Registry",
    "REGISTRY",
    "Sig",
    "signature",
    "tensor_extent",
    "shape_tuple",
    "tensor_nbytes",
    "acc_dtype",
    "storage_dtype",
    "OPERATORS",
    "GraphNode",
    "GraphSpec",
    "parse_graph",
    "graph_wire",
    "MAX_GRAPH_NODES",
    "MAX_GRAPH_TENSORS",
    "GRAPH_ALIGN",
]
