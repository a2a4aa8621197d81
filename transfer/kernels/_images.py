"""Data-pipeline preprocessing: crop, flip, transpose (HWC <-> CHW and any other order), normalize.

crop, flip and transpose move elements and never compute with them, so one kernel
serves every dtype, on the GPU too (bfloat16 moves as its 16-bit patterns).
normalize turns uint8 images into float16, bfloat16 or float32, with a mean and a
std per channel, optionally changing the layout in the same pass (uint8 HWC in,
float CHW out: what a model wants from a decoder's output).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import _cuda
from ._basic import light, register_both
from ._checks import fail, param_axes, param_choice, param_float, param_floats
from ._registry import Operator, Sig
from ._tensors import ALL, TensorRef

__all__ = ["LAYOUTS"]

#: Image layouts normalize knows, by rank; each names the channel axis C.
LAYOUTS = ("NCHW", "NHWC", "CHW", "HWC")


# --- crop ---------------------------------------------------------------------------------------
def _check_crop(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    x, y = i[0].shape, o[0].shape
    if len(y) != len(x):
        raise fail("crop", f"output must have the input's {len(x)} dimensions, got shape {y}")
    start = p.get("start")
    if type(start) is not list or len(start) != len(x):
        raise fail("crop", f"parameter 'start' must be a list of {len(x)} offsets (one per dimension)")
    for d, (s, n, m) in enumerate(zip(start, y, x)):
        if type(s) is not int or s < 0 or s + n > m:
            raise fail("crop", f"dimension {d}: [{s}, {s} + {n}) is not inside [0, {m})")
    if i[0].dtype != o[0].dtype:
        raise fail("crop", "input and output dtypes differ (use cast)")


def _crop(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    y[0][...] = x[0][tuple(slice(s, s + n) for s, n in zip(p["start"], y[0].shape))]


light(Operator("crop", 1, 1, check=_check_crop, doc="out = x[start[0]:start[0]+out.shape[0], ...]: a box of x"))
register_both("crop", [(d, d) for d in ALL], _crop, gpu=True)


# --- flip ---------------------------------------------------------------------------------------
def _check_flip(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    if i[0].shape != o[0].shape:
        raise fail("flip", f"shapes differ: {i[0].shape} vs {o[0].shape}")
    param_axes("flip", p, len(i[0].shape), "axes")


def _flip(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    y[0][...] = xp.flip(x[0], axis=tuple(p["axes"]))


light(Operator("flip", 1, 1, check=_check_flip, doc="out = x reversed along axes ([3] on NCHW: a horizontal flip, [2] a vertical one)"))
register_both("flip", [(d, d) for d in ALL], _flip, gpu=True)


# --- transpose ----------------------------------------------------------------------------------
def _check_transpose(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    axes = param_axes("transpose", p, len(i[0].shape), "axes", permutation=True)
    want = tuple(i[0].shape[a] for a in axes)
    if o[0].shape != want:
        raise fail("transpose", f"output must have shape {want}, got {o[0].shape}")


def _transpose(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    y[0][...] = x[0].transpose(tuple(p["axes"]))


light(Operator("transpose", 1, 1, check=_check_transpose, doc="out = x.transpose(axes): HWC -> CHW is axes [2, 0, 1], NHWC -> NCHW [0, 3, 1, 2]"))
register_both("transpose", [(d, d) for d in ALL], _transpose, gpu=True)


# --- normalize ----------------------------------------------------------------------------------
def layouts(op: str, p: Mapping[str, Any], ndim: int) -> tuple[str, str]:
    """(input layout, output layout): NCHW by default, the output's the input's unless given."""
    src = param_choice(op, p, "layout", LAYOUTS)
    dst = p.get("out_layout", src)
    if dst not in LAYOUTS or type(dst) is not str or sorted(dst) != sorted(src):
        raise fail(op, f"out_layout {dst!r} must be a layout with the same letters as {src!r}")
    if len(src) != ndim:
        raise fail(op, f"layout {src} needs {len(src)} dimensions, the input has {ndim}")
    return src, dst


def _check_normalize(i: list[TensorRef], o: list[TensorRef], p: Mapping[str, Any]) -> None:
    x, y = i[0].shape, o[0].shape
    src, dst = layouts("normalize", p, len(x))
    want = tuple(x[src.index(ch)] for ch in dst)
    if y != want:
        raise fail("normalize", f"output must have shape {want} ({src} -> {dst}), got {y}")
    c = x[src.index("C")]
    if c > 4096:
        raise fail("normalize", f"{c} channels: at most 4096")
    param_floats("normalize", p, "mean", c)
    if any(s == 0 for s in param_floats("normalize", p, "std", c)):
        raise fail("normalize", "std must be non-zero")
    param_float("normalize", p, "scale", 1.0)


def _tables(p: Mapping[str, Any], dst: str, c: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale / std, mean / std) as float32, shaped to broadcast along dst's channel axis:
    (x * scale - mean) / std == x * (scale / std) - mean / std, one multiply-add per element."""
    shape = tuple(c if ch == "C" else 1 for ch in dst)
    std = np.asarray(p["std"], dtype=np.float64)
    a = (float(p.get("scale", 1.0)) / std).astype(np.float32).reshape(shape)
    b = (np.asarray(p["mean"], dtype=np.float64) / std).astype(np.float32).reshape(shape)
    return a, b


def _view(x: Any, p: Mapping[str, Any]) -> tuple[Any, str]:
    src, dst = layouts("normalize", p, x.ndim)
    return x.transpose(tuple(src.index(ch) for ch in dst)), dst


def _normalize(x: list[Any], y: list[Any], p: Mapping[str, Any], xp: Any) -> None:
    v, dst = _view(x[0], p)
    a, b = _tables(p, dst, v.shape[dst.index("C")])
    if y[0].dtype == np.float32:  # computed in the output itself: no temporaries of its size
        xp.multiply(v, xp.asarray(a), out=y[0])
        xp.subtract(y[0], xp.asarray(b), out=y[0])
        return
    y[0][...] = v.astype(np.float32) * xp.asarray(a) - xp.asarray(b)  # rounded once from float32


def _normalize_cuda(x: list[Any], y: list[Any], p: Mapping[str, Any], cp: Any, sig: Sig) -> None:
    v, dst = _view(x[0], p)
    a, b = _tables(p, dst, v.shape[dst.index("C")])
    _cuda.normalize(v, _cuda.constant(a, cp), _cuda.constant(b, cp), y[0], sig[1], cp)


light(Operator(
    "normalize", 1, 1, check=_check_normalize,
    doc="out = (x * scale - mean[c]) / std[c], uint8 -> float; layout NCHW|NHWC|CHW|HWC, out_layout may differ",
))
register_both("normalize", [("uint8", d) for d in ("float16", "bfloat16", "float32")], _normalize, _normalize_cuda)
