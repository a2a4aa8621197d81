"""Running a graph's nodes in order: the one loop every device uses, in or out of process.

A *step* is one node's kernel over its operands: ``(node, kernel, inputs, outputs, params,
deps, name)``. A node whose input came from a failed node is skipped with that node's error;
a node's own error names it (``graph node i (op): ...``) when it has a name; nothing else stops
the run. The outcome per step is data, not exceptions, so that it can cross a process
boundary (`backends/_devproc.py`) and mean the same on both sides.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from .. import errors as E

__all__ = ["Step", "run_steps", "run_through", "first_error", "DONE", "FAILED", "SKIPPED"]

#: (node index, kernel, inputs, outputs, params, indices of the nodes it reads, name or None)
Step = tuple[int, Any, Any, Any, Any, tuple[int, ...], "str | None"]

#: An outcome is (state, value, seconds): DONE with the kernel's result, FAILED with the error,
#: SKIPPED with the index of the failed node it reads.
DONE, FAILED, SKIPPED = 0, 1, 2


def run_steps(steps: Sequence[Step], failed: set[int], compute: Callable[[Any, Any, Any, Any], Any]) -> list[tuple[int, Any, float]]:
    """Run `steps` in order with `compute(kernel, inputs, outputs, params)`. `failed` holds the
    nodes that failed before (other stretches of the run); it gains this run's failures."""
    out: list[tuple[int, Any, float]] = []
    clock = time.perf_counter
    for i, kernel, ins, outs, params, deps, name in steps:
        for j in deps:
            if j in failed:
                failed.add(i)
                out.append((SKIPPED, j, 0.0))
                break
        else:
            t0 = clock()
            try:
                result = compute(kernel, ins, outs, params)
            except E.TransferError as exc:
                err: E.TransferError = exc if name is None else type(exc)(f"graph node {i} ({name}): {exc.message}")
            except Exception as exc:  # a backend failure fails this node (and what reads it)
                err = E.as_transfer_error(exc)
            else:
                out.append((DONE, result, clock() - t0))
                continue
            failed.add(i)
            out.append((FAILED, err, clock() - t0))
    return out


def first_error(outcomes: Sequence[tuple[int, Any, float]]) -> E.TransferError | None:
    """A run's answer from its steps' outcomes: the first failure in node order (a skipped
    node's is the error of the node it read), or None."""
    errors: list[E.TransferError | None] = []
    for state, value, _ in outcomes:
        errors.append(value if state == FAILED else errors[value] if state == SKIPPED else None)
    return next((e for e in errors if e is not None), None)


def run_through(steps: Sequence[Step], compute: Callable[[Any, Any, Any, Any], Any]) -> tuple[float, E.TransferError | None]:
    """Run `steps` straight through, timed once: (seconds, None). When a node raises, run them
    again node by node (`run_steps`, which names it and skips what read it): (their seconds,
    the first error). Kernels are pure, and a run writes none of its inputs, so the second run
    leaves what the first would have."""
    clock = time.perf_counter
    t0 = clock()
    try:
        for _, kernel, ins, outs, params, _, _ in steps:
            compute(kernel, ins, outs, params)
    except Exception:  # noqa: BLE001 - a node failed: again, node by node, for its error
        outcomes = run_steps(steps, set(), compute)
        return sum(o[2] for o in outcomes), first_error(outcomes)
    return clock() - t0, None
