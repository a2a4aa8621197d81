"""A linear and the relu that rectifies its output in place, run as one step on NumPy
(`kernels.fuse_steps`, with the native `bias_relu_f32`), leave the bytes the two kernels
leave: NumPy's add and maximum are the oracle, NaN, infinities and signed zeros included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from transfer import _native
from transfer.kernels import REGISTRY, fuse_steps, run_steps

F32 = ("float32",) * 4
_VALUES = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


def _oracle(y: np.ndarray, b: np.ndarray) -> np.ndarray:
    r = y.copy()
    with np.errstate(invalid="ignore", over="ignore"):  # (inf + -inf: NaN, as the kernel's)
        np.add(r, b, out=r)
    np.maximum(r, np.zeros((), np.float32), out=r)
    return r


@settings(max_examples=200, deadline=None)
@given(data=st.data(), rows=st.integers(1, 9), cols=st.integers(1, 40))
def test_bias_relu_is_numpy_s_add_then_maximum(data: Any, rows: int, cols: int) -> None:
    y = data.draw(hnp.arrays(np.float32, (rows, cols), elements=_VALUES))
    b = data.draw(hnp.arrays(np.float32, (cols,), elements=_VALUES))
    want = _oracle(y, b)
    _native.bias_relu_f32(y, b)
    assert y.tobytes() == want.tobytes()


def test_bias_relu_large_and_n_d() -> None:
    rng = np.random.default_rng(1)
    y = rng.standard_normal((3, 300, 257)).astype(np.float32)  # (over 64 KiB: without the GIL)
    b = rng.standard_normal(257).astype(np.float32)
    want = _oracle(y, b)
    _native.bias_relu_f32(y, b)
    assert y.tobytes() == want.tobytes()


@pytest.mark.parametrize("y, b, err, words", [
    (np.zeros((2, 4), np.float64), np.zeros(4, np.float32), TypeError, "out must be C-contiguous float32"),
    (np.zeros((2, 4), np.float32), np.zeros(4, np.float16), TypeError, "bias must be C-contiguous float32"),
    (np.zeros((4, 2), np.float32).T, np.zeros(4, np.float32), ValueError, "not C-contiguous"),
    (np.zeros((2, 4), np.float32), np.zeros(3, np.float32), ValueError, "last axis must be the bias's length (3)"),
    (np.zeros((2, 4), np.float32), np.zeros(0, np.float32), ValueError, "bias's length (0)"),
])
def test_bias_relu_refuses(y: np.ndarray, b: np.ndarray, err: type[Exception], words: str) -> None:
    with pytest.raises(err, match=words.replace("(", r"\(").replace(")", r"\)")):
        _native.bias_relu_f32(y, b)


def test_bias_relu_refuses_read_only_memory() -> None:
    y = np.zeros((2, 4), np.float32)
    y.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        _native.bias_relu_f32(y, np.zeros(4, np.float32))
    assert not y.any()


def _mlp_steps(x: np.ndarray, ws: list[np.ndarray], y: np.ndarray, relu_out: str = "same",
               dtype: str = "float32") -> list[Any]:
    """linear -> relu -> linear, the relu in place on the first linear's output (or not)."""
    lin = REGISTRY.lookup("linear", (dtype,) * 4, "cpu")
    relu = REGISTRY.lookup("relu", (dtype,) * 2, "cpu")
    h = np.empty((x.shape[0], ws[0].shape[0]), dtype)
    a = h if relu_out == "same" else np.empty_like(h)
    return [(0, lin, [x, ws[0], ws[1]], [h], {}, (), None),
            (1, relu, [h], [a], {}, (0,), None),
            (2, lin, [a, ws[2], ws[3]], [y], {}, (1,), None)]


def _run(steps: list[Any]) -> list[Any]:
    return run_steps(steps, set(), lambda kernel, ins, outs, params: kernel.run(ins, outs, params, np))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), rows=st.integers(1, 17), k=st.integers(1, 33), n=st.integers(1, 33))
def test_a_fused_mlp_leaves_the_bytes_of_its_kernels_one_by_one(data: Any, rows: int, k: int, n: int) -> None:
    floats = st.floats(-4, 4, width=32)
    x = data.draw(hnp.arrays(np.float32, (rows, k), elements=floats))
    ws = [data.draw(hnp.arrays(np.float32, shape, elements=floats)) for shape in ((n, k), (n,), (3, n), (3,))]
    fused_y, plain_y = np.empty((rows, 3), np.float32), np.empty((rows, 3), np.float32)
    fused = fuse_steps(_mlp_steps(x, ws, fused_y))
    assert [s[1].op for s in fused] == ["linear", "relu", "linear"]
    assert fused[0][1] is not REGISTRY.lookup("linear", F32, "cpu")  # (the linear does the relu's work)
    outcomes = _run(fused)
    assert [o[0] for o in outcomes] == [0, 0, 0]
    _run(_mlp_steps(x, ws, plain_y))
    assert fused_y.tobytes() == plain_y.tobytes()


def test_fused_only_where_the_relu_runs_in_place_on_a_float32_linear_s_output() -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    ws = [rng.standard_normal(s).astype(np.float32) for s in ((6, 8), (6,), (3, 6), (3,))]
    y = np.empty((4, 3), np.float32)
    kept = _mlp_steps(x, ws, y, relu_out="apart")  # the relu writes its own block
    assert [s[1] for s in fuse_steps(kept)] == [s[1] for s in kept]
    x64, ws64 = x.astype(np.float64), [w.astype(np.float64) for w in ws]
    kept = _mlp_steps(x64, ws64, y.astype(np.float64), dtype="float64")
    assert [s[1] for s in fuse_steps(kept)] == [s[1] for s in kept]
