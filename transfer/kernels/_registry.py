"""Operators, kernels and the registry that picks a kernel by dtype signature and device kind.

An *operator* is what the wire names: its arity and a shape/parameter check the
planner runs before anything is touched. A *kernel* is one implementation of it
for some dtype signatures (the dtypes of its inputs then its outputs) on one
device kind. The registry maps (operator, signature, kind) to a kernel, says
which signatures exist (every error lists them), and says where an operator may
fall back to another kind when a kind lacks a signature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterable, Mapping, Sequence

import numpy as np

from .. import errors as E
from ._tensors import TensorRef

__all__ = ["Operator", "Kernel", "Registry", "REGISTRY", "OPERATORS", "Sig", "KernelFn", "CudaFn", "signature"]

#: (dtype of each input..., dtype of each output...).
Sig = tuple[str, ...]
#: An array-API kernel: (inputs, outputs, params, xp) -> result or None. Runs on NumPy, and on
#: CuPy for signatures with no CUDA kernel of their own.
KernelFn = Callable[[list[Any], list[Any], Mapping[str, Any], Any], Any]
#: A kernel compiled from CUDA source (`_cuda`): (inputs, outputs, params, cupy, signature).
CudaFn = Callable[[list[Any], list[Any], Mapping[str, Any], Any, Sig], Any]
Check = Callable[[list[TensorRef], list[TensorRef], Mapping[str, Any]], None]


def _no_check(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class Operator:
    """What the daemon checks before any kernel runs (dtype combinations are the registry's)."""

    name: str
    n_inputs: int
    n_outputs: int
    #: Outputs may be exactly the same range as the first input (in place).
    in_place: bool = False
    check: Check = _no_check
    doc: str = ""


@dataclass(frozen=True)
class Kernel:
    """One implementation: `fn` (array API) and, for CuPy, optionally `cuda` (compiled from source).

    `sig` is set on what `Registry.lookup` returns: the signature it was chosen for."""

    op: str
    device_kind: str
    fn: KernelFn
    cuda: CudaFn | None = None
    sig: Sig = ()

    def run(self, ins: list[Any], outs: list[Any], params: Mapping[str, Any], xp: Any) -> Any:
        """The CUDA kernel where there is one and the arrays are CuPy's; else the array-API one
        (NumPy, and the stream simulation, which keeps device memory in host RAM)."""
        if self.cuda is not None and xp is not np:
            return self.cuda(ins, outs, params, xp, self.sig)
        return self.fn(ins, outs, params, xp)


def signature(inputs: Sequence[TensorRef], outputs: Sequence[TensorRef]) -> Sig:
    return tuple(t.dtype for t in (*inputs, *outputs))


def _fmt(sig: Sig, n_in: int) -> str:
    return f"({', '.join(sig[:n_in])}) -> ({', '.join(sig[n_in:])})"


@dataclass
class Registry:
    """(operator, signature, device kind) -> kernel."""

    operators: dict[str, Operator] = field(default_factory=dict)
    _kernels: dict[tuple[str, str], dict[Sig, Kernel]] = field(default_factory=dict)
    #: (operator, kind) -> the kind it may run on instead, for signatures `kind` lacks.
    _fallback: dict[tuple[str, str], str] = field(default_factory=dict)

    def operator(self, op: Operator) -> Operator:
        self.operators[op.name] = op
        return op

    def register(self, op: str, sigs: Iterable[Sig], device_kind: str, fn: KernelFn, cuda: CudaFn | None = None) -> None:
        arity = self.operators[op].n_inputs + self.operators[op].n_outputs
        table = self._kernels.setdefault((op, device_kind), {})
        for sig in sigs:
            if len(sig) != arity:
                raise ValueError(f"{op}: signature {sig} has {len(sig)} dtypes, the operator {arity} operands")
            table[sig] = Kernel(op, device_kind, fn, cuda, sig)

    def fallback(self, op: str, kind: str, to: str) -> None:
        """Where `kind` has no kernel for a signature, `op` may run on `to` (host operands only)."""
        self._fallback[(op, kind)] = to

    def signatures(self, op: str, device_kind: str) -> list[Sig]:
        return sorted(self._kernels.get((op, device_kind), {}))

    def get(self, op: str, sig: Sig, device_kind: str) -> Kernel | None:
        return self._kernels.get((op, device_kind), {}).get(sig)

    def lookup(self, op: str, sig: Sig, device_kind: str) -> Kernel:
        """The kernel, or a clear error: unknown operator, or the signatures this kind has."""
        k = self.get(op, sig, device_kind)
        if k is not None:
            return k
        if op not in self.operators:
            raise E.UnknownOperation(f"unknown operator {op!r}; known: {', '.join(sorted(self.operators))}")
        n_in = self.operators[op].n_inputs
        have = self.signatures(op, device_kind)
        shown = ", ".join(_fmt(s, n_in) for s in have[:16]) + (f", ... ({len(have)} in all)" if len(have) > 16 else "")
        raise E.InvalidField(
            f"{op} has no {device_kind} kernel for {_fmt(sig, n_in)}; supported dtypes: {shown or 'none'}"
        )

    def select(self, op: str, sig: Sig, device_kind: str, movable_to: Collection[str] = ()) -> tuple[str, Kernel]:
        """(kind, kernel) for a request placed on `device_kind`: that kind's kernel; else, where
        the registry lets `op` fall back and the operands may move to that kind (`movable_to`:
        kinds present, when every operand is host memory), the fallback kind's; else the error."""
        k = self.get(op, sig, device_kind)
        if k is not None:
            return device_kind, k
        to = self._fallback.get((op, device_kind))
        other = self.get(op, sig, to) if to is not None else None
        if to is not None and other is not None and to in movable_to:
            return to, other
        try:
            self.lookup(op, sig, device_kind)
        except E.InvalidField as exc:
            if other is not None:
                raise E.InvalidField(f"{exc.message}; a {to} kernel exists, but the operands cannot move there "
                                     f"(one is in device memory, or the request pins a device)") from None
            raise
        raise AssertionError("unreachable: lookup raises where get found nothing")


REGISTRY = Registry()
#: name -> Operator: every operator the daemon knows (filled by the operator modules).
OPERATORS: dict[str, Operator] = REGISTRY.operators
