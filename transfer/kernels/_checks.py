"""Parameter and shape checks shared by the operators.

Everything here runs in the daemon on values from the wire, before any memory is
touched: each helper either returns a clean Python value or raises `InvalidField`
naming the operator and the parameter. `transfer._fields.params` has already bounded
the map (32 entries; numbers, bools, nil, short strings, lists of up to 4,096 numbers).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from .. import errors as E
from ._tensors import TensorRef

__all__ = [
    "param_float", "param_int", "param_pair", "param_axis", "param_axes", "param_choice", "param_floats",
    "same_shape", "ndim_at_least", "fail",
]

_MISSING = object()


def fail(op: str, msg: str) -> E.InvalidField:
    return E.InvalidField(f"{op}: {msg}")


def param_float(op: str, p: Mapping[str, Any], key: str, default: Any = _MISSING) -> float:
    v = p.get(key, default)
    if v is _MISSING or v is None:
        raise fail(op, f"parameter {key!r} is required")
    if type(v) not in (int, float) or not math.isfinite(v):
        raise fail(op, f"parameter {key!r} must be a finite number, got {v!r}")
    return float(v)


def param_int(op: str, p: Mapping[str, Any], key: str, default: Any = _MISSING, lo: int = 0, hi: int = 1 << 40) -> int:
    v = p.get(key, default)
    if v is _MISSING or v is None:
        raise fail(op, f"parameter {key!r} is required")
    if type(v) is not int or not lo <= v <= hi:
        raise fail(op, f"parameter {key!r} must be a whole number in [{lo}, {hi}], got {v!r}")
    return v


def param_pair(op: str, p: Mapping[str, Any], key: str, default: int, lo: int, hi: int = 1 << 20) -> tuple[int, int]:
    """An int, or a list of two ints (height, width)."""
    v = p.get(key, default)
    pair = [v, v] if type(v) is int else v
    if type(pair) is not list or len(pair) != 2 or any(type(e) is not int or not lo <= e <= hi for e in pair):
        raise fail(op, f"parameter {key!r} must be a whole number or two, each in [{lo}, {hi}], got {v!r}")
    return pair[0], pair[1]


def param_axis(op: str, p: Mapping[str, Any], ndim: int, key: str = "axis", default: Any = None) -> int | None:
    """A single axis in [-ndim, ndim), normalised; None when absent and no default."""
    v = p.get(key, default)
    if v is None:
        return None
    if type(v) is not int or not -ndim <= v < ndim:
        raise fail(op, f"{key} {v!r} is out of range for {ndim} dimensions")
    return v % ndim


def param_axes(op: str, p: Mapping[str, Any], ndim: int, key: str, permutation: bool = False) -> tuple[int, ...]:
    """Distinct axes (a list of ints in [-ndim, ndim)); with `permutation`, every axis once."""
    v = p.get(key)
    if type(v) is not list or any(type(e) is not int or not -ndim <= e < ndim for e in v):
        raise fail(op, f"parameter {key!r} must be a list of axes in [{-ndim}, {ndim}), got {v!r}")
    axes = tuple(e % ndim for e in v)
    if len(set(axes)) != len(axes):
        raise fail(op, f"parameter {key!r} repeats an axis: {v!r}")
    if permutation and len(axes) != ndim:
        raise fail(op, f"parameter {key!r} must name each of the {ndim} axes once, got {v!r}")
    return axes


def param_choice(op: str, p: Mapping[str, Any], key: str, choices: tuple[str, ...]) -> str:
    """One of `choices`; the first is the default."""
    v = p.get(key, choices[0])
    if v not in choices or type(v) is not str:
        raise fail(op, f"parameter {key!r} must be one of {', '.join(choices)}, got {v!r}")
    return v


def param_floats(op: str, p: Mapping[str, Any], key: str, n: int) -> list[float]:
    v = p.get(key)
    if type(v) is not list or len(v) != n or any(type(e) not in (int, float) or not math.isfinite(e) for e in v):
        raise fail(op, f"parameter {key!r} must be a list of {n} finite numbers")
    return [float(e) for e in v]


def same_shape(op: str, a: TensorRef, b: TensorRef) -> None:
    if a.shape != b.shape:
        raise fail(op, f"shapes differ: {a.shape} vs {b.shape}")


def ndim_at_least(op: str, t: TensorRef, n: int, what: str) -> None:
    if len(t.shape) < n:
        raise fail(op, f"{what} needs at least {n} dimensions, got shape {t.shape}")
