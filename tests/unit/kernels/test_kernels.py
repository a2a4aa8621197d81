"""Every operator's kernels against a float64 NumPy reference, over shapes, strides and dtypes.

The kernels run as the daemon runs them (the operator's check, then the registry's
kernel for the dtype signature) on NumPy views with the strides hypothesis draws,
outputs included: a strided output must leave the bytes between its elements alone.
References are written independently (einsum, explicit loops, math.erf) in float64
from the same input values.

Tolerances (docs/operators.md): with u the unit roundoff of the output dtype, a
result may differ from the reference by 2u|ref| (the output's rounding, and one more
for an intermediate's) plus, where the kernel combines n terms in float32 (float64 for
float64), (n + 2) * u_acc * (the sum of the terms' magnitudes), plus one subnormal
step of the output dtype. Integer results and data movement are exact.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transfer
from transfer.kernels import OPERATORS, REGISTRY, TensorRef

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FLOATS = ["float16", "bfloat16", "float32", "float64"]
U = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24, "float64": 2.0**-53}
#: The spacing of subnormals: below the smallest normal, rounding is absolute, not relative.
TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149, "float64": 2.0**-1074}


def u_acc(dtype: str) -> float:
    return 2.0**-53 if dtype == "float64" else 2.0**-24


def ref(t: Any) -> TensorRef:
    return TensorRef(0, t.dtype.name, tuple(t.shape), tuple(t.strides))


def run(op: str, ins: list[np.ndarray], outs: list[np.ndarray], p: dict[str, Any] | None = None, kind: str = "cpu") -> Any:
    """As the daemon: the operator's check, the kernel for the signature, run on the views."""
    p = p or {}
    OPERATORS[op].check([ref(t) for t in ins], [ref(t) for t in outs], p)
    sig = tuple(t.dtype.name for t in (*ins, *outs))
    return REGISTRY.lookup(op, sig, kind).run(ins, outs, p, np)


def strided(data: st.DataObject, arr: np.ndarray) -> np.ndarray:
    """`arr`'s values in a view with other strides: every other element of a larger buffer,
    reversed-then-transposed storage, or plain."""
    how = data.draw(st.sampled_from(["plain", "step", "transposed"]))
    if how == "plain" or arr.ndim == 0:
        return arr.copy()
    if how == "step":
        big = np.zeros(arr.shape[:-1] + (arr.shape[-1] * 2,), arr.dtype)
        v = big[..., ::2]
    else:
        v = np.zeros(arr.shape[::-1], arr.dtype).T
    v[...] = arr
    return v


def out_view(data: st.DataObject, shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """(output view, the buffer behind it): maybe strided, the gaps filled with a sentinel."""
    buf = np.full(shape[:-1] + (shape[-1] * 2,) if shape else (2,), 77, dtype=dtype)
    if shape and data.draw(st.booleans()):
        return buf[..., ::2], buf
    flat = np.full(shape, 77, dtype=dtype)
    return flat, flat


def gaps_untouched(view: np.ndarray, buf: np.ndarray) -> None:
    if view.base is buf and view.ndim:
        assert (buf[..., 1::2] == buf.dtype.type(77)).all(), "a strided output wrote between its elements"


def values(data: st.DataObject, shape: tuple[int, ...], dtype: str, scale: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    return (rng.standard_normal(shape) * scale).astype(dtype)


def close(got: np.ndarray, want: np.ndarray, dtype: str, terms: int = 1, mag: np.ndarray | None = None) -> None:
    """|got - want| <= 2u|want| + (terms + 2) * u_acc * mag + one subnormal step (mag: the
    summed terms' magnitudes)."""
    g = got.astype(np.float64)
    mag = np.abs(want) if mag is None else mag
    bound = 2 * U[dtype] * np.abs(want) + (terms + 2) * u_acc(dtype) * mag + TINY[dtype]
    err = np.abs(g - want)
    assert (err <= bound).all(), f"max error {err.max()} ({dtype}), worst excess {(err - bound).max()}"


f64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
dims = st.integers(1, 5)


# --- matmul, linear, conv2d ---------------------------------------------------------------------
@SETTINGS
@given(st.data(), st.sampled_from(FLOATS + ["int8"]), dims, dims, dims, st.lists(st.integers(1, 3), max_size=2), st.booleans())
def test_matmul_broadcasts_batches(data, dtype, m, k, n, batch, b_is_matrix) -> None:
    ba = tuple(batch)
    bb = () if b_is_matrix else tuple(data.draw(st.sampled_from([1, d])) for d in ba)
    if dtype == "int8":
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        a, b = (rng.integers(-128, 128, s).astype(np.int8) for s in (ba + (m, k), bb + (k, n)))
        out_dtype = "int32"
    else:
        a, b, out_dtype = values(data, ba + (m, k), dtype), values(data, bb + (k, n), dtype), dtype
    a, b = strided(data, a), strided(data, b)
    y, buf = out_view(data, ba + (m, n), out_dtype)
    run("matmul", [a, b], [y])
    want = np.einsum("...ik,...kj->...ij", f64(a), f64(b))  # broadcasts the batch dimensions
    if dtype == "int8":  # int32 accumulation: exact (|sum| < 5 * 128 * 128)
        assert np.array_equal(y, want.astype(np.int64))
    else:
        close(y, want, dtype, k, np.matmul(np.abs(f64(a)), np.abs(f64(b))))
    gaps_untouched(y, buf)


def test_int8_matmul_accumulates_in_int32_not_int8() -> None:
    a = np.full((2, 300), 100, np.int8)
    b = np.full((300, 3), 100, np.int8)
    y = np.zeros((2, 3), np.int32)
    run("matmul", [a, b], [y])
    assert (y == 300 * 100 * 100).all()  # 3,000,000: far past int8 and int16


def test_half_sums_accumulate_in_float32() -> None:
    """4096 ones in float16: a float16 accumulator stops at 2048 (2048 + 1 rounds back to 2048)."""
    for dt in ("float16", "bfloat16"):
        x = np.ones(4096, dt)
        y = np.zeros((), dt)
        run("sum", [x], [y])
        assert float(y) == 4096.0, dt
        a, b = np.ones((1, 4096), dt), np.ones((4096, 1), dt)
        y2 = np.zeros((1, 1), dt)
        run("matmul", [a, b], [y2])
        assert float(y2[0, 0]) == 4096.0, dt


@SETTINGS
@given(st.data(), st.sampled_from(FLOATS + ["int8"]), st.lists(st.integers(1, 3), max_size=2), dims, dims)
def test_linear(data, dtype, lead, k, n) -> None:
    if dtype == "int8":
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        x, w = rng.integers(-128, 128, (*lead, k)).astype(np.int8), rng.integers(-128, 128, (n, k)).astype(np.int8)
        b, out_dtype = rng.integers(-1000, 1000, n).astype(np.int32), "int32"
    else:
        x, w, b, out_dtype = values(data, (*lead, k), dtype), values(data, (n, k), dtype), values(data, (n,), dtype), dtype
    x, w, b = strided(data, x), strided(data, w), strided(data, b)
    y, buf = out_view(data, (*lead, n), out_dtype)
    run("linear", [x, w, b], [y])
    want = f64(x) @ f64(w).T + f64(b)
    if dtype == "int8":
        assert np.array_equal(y, want.astype(np.int64))
    else:
        close(y, want, dtype, k + 1, np.abs(f64(x)) @ np.abs(f64(w)).T + np.abs(f64(b)))
    gaps_untouched(y, buf)


def conv_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, stride: tuple[int, int], pad: tuple[int, int], dil: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Direct convolution, one output pixel at a time: (result, sum of the terms' magnitudes)."""
    n, c, h, wd = x.shape
    o, _, kh, kw = w.shape
    xp = np.pad(f64(x), ((0, 0), (0, 0), (pad[0], pad[0]), (pad[1], pad[1])))
    ho = (h + 2 * pad[0] - dil[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wd + 2 * pad[1] - dil[1] * (kw - 1) - 1) // stride[1] + 1
    out, mag = np.zeros((n, o, ho, wo)), np.zeros((n, o, ho, wo))
    for i in range(ho):
        for j in range(wo):
            win = xp[:, :, i * stride[0] : i * stride[0] + dil[0] * (kh - 1) + 1 : dil[0], j * stride[1] : j * stride[1] + dil[1] * (kw - 1) + 1 : dil[1]]
            out[:, :, i, j] = np.einsum("nckl,ockl->no", win, f64(w)) + f64(b)
            mag[:, :, i, j] = np.einsum("nckl,ockl->no", np.abs(win), np.abs(f64(w))) + np.abs(f64(b))
    return out, mag


@SETTINGS
@given(st.data(), st.sampled_from(FLOATS + ["int8"]), st.integers(1, 2), st.integers(1, 3), st.integers(1, 3),
       st.integers(3, 7), st.integers(3, 7), st.integers(1, 3), st.integers(1, 3))
def test_conv2d(data, dtype, n, c, o, h, wd, kh, kw) -> None:
    stride = (data.draw(st.integers(1, 2)), data.draw(st.integers(1, 2)))
    pad = (data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2)))
    dil = (data.draw(st.integers(1, 2)), 1)
    if h + 2 * pad[0] < dil[0] * (kh - 1) + 1:
        return
    if dtype == "int8":
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        x, w = rng.integers(-128, 128, (n, c, h, wd)).astype(np.int8), rng.integers(-128, 128, (o, c, kh, kw)).astype(np.int8)
        b, out_dtype = rng.integers(-99, 99, o).astype(np.int32), "int32"
    else:
        x, w, b, out_dtype = values(data, (n, c, h, wd), dtype), values(data, (o, c, kh, kw), dtype), values(data, (o,), dtype), dtype
    x, w = strided(data, x), strided(data, w)
    want, mag = conv_reference(x, w, b, stride, pad, dil)
    y, buf = out_view(data, want.shape, out_dtype)
    run("conv2d", [x, w, b], [y], {"stride": list(stride), "padding": list(pad), "dilation": list(dil)})
    if dtype == "int8":
        assert np.array_equal(y, want.astype(np.int64))
    else:
        close(y, want, dtype, c * kh * kw + 1, mag)
    gaps_untouched(y, buf)


# --- activations, softmax, layer norm -----------------------------------------------------------
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


@SETTINGS
@given(st.data(), st.sampled_from(FLOATS), shapes, st.sampled_from(["relu", "gelu", "gelu_tanh"]))
def test_activations(data, dtype, shape, which) -> None:
    x = strided(data, values(data, shape, dtype, scale=3.0))
    y, buf = out_view(data, shape, dtype)
    op, p = ("gelu", {"approximate": "tanh"}) if which == "gelu_tanh" else (which, {})
    run(op, [x], [y], p)
    v = f64(x)
    if which == "relu":
        want = np.maximum(v, 0)
        assert np.array_equal(f64(y), want)  # exact in every dtype
    else:
        if which == "gelu":
            want = 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))
        else:
            want = 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
        close(y, want, dtype, 8, np.abs(v))  # float64's gelu too: its erf is to float64's precision
    gaps_untouched(y, buf)


@SETTINGS
@given(st.data(), st.sampled_from(["float32", "float64"]))
def test_erf_to_the_dtypes_precision(data, dtype) -> None:
    """The CPU kernels' erf (NumPy has none) against math.erf: within 1e-15 in float64, as the
    GPU's erf (a float64 gelu on the CPU once differed from the GPU's by 1e-8), within 5e-7 in
    float32 (the fit's 1.2e-7 and float32's rounding); NaN stays NaN, and the tails reach -1 and 1."""
    from transfer.kernels._layers import erf

    width = 64 if dtype == "float64" else 32
    x = np.array(data.draw(st.lists(st.floats(width=width), min_size=1, max_size=64)), dtype=dtype)
    with np.errstate(over="ignore", invalid="raise", divide="raise"):  # x * x may overflow: exp(-inf) is 0
        got = erf(x, np).astype(np.float64)
    want = np.array([math.erf(v) for v in x.astype(np.float64)])
    assert np.array_equal(np.isnan(got), np.isnan(want))
    tol = 1e-15 if dtype == "float64" else 5e-7
    assert (np.abs(got - want)[~np.isnan(want)] <= tol).all()


@SETTINGS
@given(st.data(), st.sampled_from(FLOATS), shapes)
def test_softmax(data, dtype, shape) -> None:
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    x = strided(data, values(data, shape, dtype, scale=4.0))
    y, buf = out_view(data, shape, dtype)
    run("softmax", [x], [y], {"axis": axis})
    d = f64(x) - f64(x).max(axis=axis, keepdims=True)
    e = np.exp(d)
    want = e / e.sum(axis=axis, keepdims=True)
    # exp's argument x - max is itself rounded in the computing type: relative error up to
    # u_acc * |x - max| in each output (exp's derivative), besides the sum's.
    close(y, want, dtype, shape[axis] + 8, mag=np.abs(want) * (1 + np.abs(d)))
    gaps_untouched(y, buf)


@SETTINGS
@given(st.data(), st.sampled_from(FLOATS), st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple))
def test_layer_norm(data, dtype, shape) -> None:
    k = data.draw(st.integers(1, len(shape)))
    x = strided(data, values(data, shape, dtype, scale=2.0) + np.asarray(3, dtype))
    g, b = values(data, shape[-k:], dtype), values(data, shape[-k:], dtype)
    y, buf = out_view(data, shape, dtype)
    eps = data.draw(st.sampled_from([1e-5, 1e-3, 0.5]))
    run("layer_norm", [x, g, b], [y], {"eps": eps})
    axes = tuple(range(len(shape) - k, len(shape)))
    v = f64(x)
    m = v.mean(axis=axes, keepdims=True)
    sd = np.sqrt(((v - m) ** 2).mean(axis=axes, keepdims=True) + eps)
    want = (v - m) / sd * f64(g) + f64(b)
    n = int(np.prod(shape[-k:]))
    mag = (np.abs(v) + np.abs(m)) / sd * np.abs(f64(g)) * 4 + np.abs(f64(b))
    close(y, want, dtype, 2 * n + 8, mag)
    gaps_untouched(y, buf)


@SETTINGS
@given(st.data(), st.sampled_from(FLOATS), shapes, st.sampled_from(["sum", "mean"]), st.booleans())
def test_float_reductions(data, dtype, shape, op, to_float32) -> None:
    axis = data.draw(st.one_of(st.none(), st.integers(-len(shape), len(shape) - 1)))
    x = strided(data, values(data, shape, dtype))
    out_dtype = "float32" if to_float32 and dtype in ("float16", "bfloat16") else dtype
    want = getattr(f64(x), op)(axis=axis)
    y = np.zeros(np.shape(want), out_dtype)
    run(op, [x], [y], {"axis": axis})
    n = x.size if axis is None else shape[axis]
    mag = np.abs(f64(x)).sum(axis=axis) / (n if op == "mean" else 1)
    close(y, want, out_dtype, n, mag)


@SETTINGS
@given(st.data(), st.sampled_from(FLOATS), shapes)
def test_scale_add_and_cast(data, dtype, shape) -> None:
    x = strided(data, values(data, shape, dtype))
    y, buf = out_view(data, shape, dtype)
    run("scale_add", [x], [y], {"a": 1.5, "b": -0.25})
    close(y, 1.5 * f64(x) - 0.25, dtype, 2, 1.5 * np.abs(f64(x)) + 0.25)
    gaps_untouched(y, buf)
    to = data.draw(st.sampled_from(FLOATS))
    z = np.zeros(shape, to)
    run("cast", [x], [z])
    assert np.array_equal(z, x.astype(to))  # as NumPy (ml_dtypes for bfloat16) rounds


# --- preprocessing ------------------------------------------------------------------------------
any_dtype = st.sampled_from(["uint8", "int16", "float32", "bfloat16", "float64", "bool"])


def anyvalues(data: st.DataObject, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    return rng.integers(0, 200, shape).astype(dtype)


@SETTINGS
@given(st.data(), any_dtype, st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple))
def test_crop_flip_transpose_move_exactly(data, dtype, shape) -> None:
    x = strided(data, anyvalues(data, shape, dtype))
    size = tuple(data.draw(st.integers(1, d)) for d in shape)
    start = [data.draw(st.integers(0, d - s)) for d, s in zip(shape, size)]
    y, buf = out_view(data, size, dtype)
    run("crop", [x], [y], {"start": start})
    assert np.array_equal(y, x[tuple(slice(a, a + s) for a, s in zip(start, size))])
    gaps_untouched(y, buf)
    axes = data.draw(st.lists(st.integers(-len(shape), len(shape) - 1), unique_by=lambda a: a % len(shape)))
    y, buf = out_view(data, shape, dtype)
    run("flip", [x], [y], {"axes": axes})
    assert np.array_equal(y, np.flip(x, axis=tuple(axes)))
    gaps_untouched(y, buf)
    perm = data.draw(st.permutations(range(len(shape))))
    y, buf = out_view(data, tuple(shape[a] for a in perm), dtype)
    run("transpose", [x], [y], {"axes": list(perm)})
    assert np.array_equal(y, x.transpose(perm))
    gaps_untouched(y, buf)


@SETTINGS
@given(st.data(), st.sampled_from(["float16", "bfloat16", "float32"]), st.sampled_from(["NCHW", "NHWC", "CHW", "HWC"]),
       st.integers(1, 4), st.integers(1, 6), st.integers(1, 6), st.integers(1, 2))
def test_normalize_with_layout_change(data, dtype, layout, c, h, w, n) -> None:
    dims_of = {"N": n, "C": c, "H": h, "W": w}
    shape = tuple(dims_of[ch] for ch in layout)
    out_layout = data.draw(st.sampled_from([lay for lay in ("NCHW", "NHWC", "CHW", "HWC") if sorted(lay) == sorted(layout)]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = strided(data, rng.integers(0, 256, shape, dtype=np.uint8))
    mean, std = rng.uniform(0, 255, c).tolist(), rng.uniform(20, 80, c).tolist()
    scale = data.draw(st.sampled_from([1.0, 1 / 255]))
    y, buf = out_view(data, tuple(dims_of[ch] for ch in out_layout), dtype)
    run("normalize", [x], [y], {"mean": mean, "std": std, "scale": scale, "layout": layout, "out_layout": out_layout})
    cshape = tuple(c if ch == "C" else 1 for ch in out_layout)
    v = f64(x).transpose(tuple(layout.index(ch) for ch in out_layout))
    want = (v * scale - f64(mean).reshape(cshape)) / f64(std).reshape(cshape)
    close(y, want, dtype, 4, (v * scale + f64(mean).reshape(cshape)) / f64(std).reshape(cshape))
    gaps_untouched(y, buf)


# --- the registry ----------------------------------------------------------------------------------
def test_signatures_pick_kernels_and_errors_list_them() -> None:
    assert REGISTRY.lookup("matmul", ("int8", "int8", "int32"), "cpu").sig == ("int8", "int8", "int32")
    with pytest.raises(transfer.InvalidField, match=r"matmul has no cpu kernel for \(int8, int8\) -> \(int8\); supported dtypes: .*\(int8, int8\) -> \(int32\)"):
        REGISTRY.lookup("matmul", ("int8", "int8", "int8"), "cpu")
    with pytest.raises(transfer.UnknownOperation, match="known:"):
        REGISTRY.lookup("fft", ("float32", "float32"), "cpu")
    # bfloat16 <-> int has no GPU kernel: cast (light) falls back to a CPU device if the operands may move ...
    assert REGISTRY.select("cast", ("bfloat16", "int32"), "gpu", {"gpu", "cpu"})[0] == "cpu"
    with pytest.raises(transfer.InvalidField, match="cannot move there"):
        REGISTRY.select("cast", ("bfloat16", "int32"), "gpu", ())
    # ... a GEMM never does: it is refused with the GPU's signatures.
    with pytest.raises(transfer.InvalidField, match="no gpu kernel"):
        REGISTRY.select("matmul", ("int16", "int16", "int16"), "gpu", {"gpu", "cpu"})
    # Where a CUDA kernel exists, the GPU registers it (bfloat16 GEMMs included); data movement moves bits.
    assert REGISTRY.lookup("matmul", ("bfloat16",) * 3, "gpu").cuda is not None
    assert REGISTRY.lookup("transpose", ("bfloat16",) * 2, "gpu").cuda is None


# --- hostile parameters: a clear error or a correct run, never a crash ------------------------------
param_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["NCHW", "HWC", "tanh", "none", "x" * 300]),
    st.lists(st.one_of(st.integers(-10, 10), st.floats(-10, 10)), max_size=6),
)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from(sorted(OPERATORS)))
def test_any_parameters_give_invalid_field_or_run(data, op) -> None:
    o = OPERATORS[op]
    keys = ["axis", "axes", "start", "stride", "padding", "dilation", "eps", "approximate", "layout", "out_layout", "mean", "std", "scale", "value", "a", "b"]
    p = data.draw(st.dictionaries(st.sampled_from(keys), param_values, max_size=5))
    shape = lambda: tuple(data.draw(st.lists(st.integers(0, 4), max_size=4)))  # noqa: E731
    dts = data.draw(st.sampled_from(REGISTRY.signatures(op, "cpu")))
    ins = [np.ones(shape(), dts[k]) for k in range(o.n_inputs)]
    outs = [np.zeros(shape(), dts[o.n_inputs + k]) for k in range(o.n_outputs)]
    try:
        OPERATORS[op].check([ref(t) for t in ins], [ref(t) for t in outs], p)
    except transfer.InvalidField:
        return
    with np.errstate(all="ignore"):
        REGISTRY.lookup(op, dts, "cpu").run(ins, outs, p, np)


# --- the GPU: CUDA kernels against the same references ----------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOATS)
def test_gpu_kernels_match_numpy(dtype: str) -> None:
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(1)

    def dev(a: np.ndarray) -> Any:
        return cp.asarray(a.view(np.uint16)) if a.dtype == ml_dtypes.bfloat16 else cp.asarray(a)

    def host(d: Any, dt: str) -> np.ndarray:
        h = cp.asnumpy(d)
        return h.view(ml_dtypes.bfloat16) if dt == "bfloat16" else h

    def both(op: str, ins: list[np.ndarray], out_shapes: list[tuple[int, ...]], p: dict[str, Any], out_dtype: str = dtype) -> tuple[np.ndarray, np.ndarray]:
        cpu = [np.zeros(s, out_dtype) for s in out_shapes]
        run(op, ins, cpu, p)
        gpu_outs = [dev(np.zeros(s, out_dtype)) for s in out_shapes]
        sig = tuple(t.dtype.name for t in (*ins, *cpu))
        REGISTRY.lookup(op, sig, "gpu").run([dev(a) for a in ins], gpu_outs, p, cp)
        return cpu[0], host(gpu_outs[0], out_dtype)

    x = (rng.standard_normal((8, 33)) * 3).astype(dtype)
    for op, p in (("relu", {}), ("gelu", {}), ("gelu", {"approximate": "tanh"}), ("softmax", {"axis": 1}), ("scale_add", {"a": 2.0, "b": 1.0})):
        c, g = both(op, [x], [x.shape], p)
        close(g, f64(c), dtype, 40, np.abs(f64(c)) + 1)
    for op in ("sum", "mean"):
        c, g = both(op, [x], [(8,)], {"axis": 1})
        close(g, f64(c), dtype, 33, np.abs(f64(x)).sum(axis=1))
    gm, bt = rng.standard_normal(33).astype(dtype), rng.standard_normal(33).astype(dtype)
    c, g = both("layer_norm", [x, gm, bt], [x.shape], {"eps": 1e-5})
    close(g, f64(c), dtype, 80, np.abs(f64(c)) + 4)
    a, b = rng.standard_normal((3, 17, 40)).astype(dtype), rng.standard_normal((40, 9)).astype(dtype)
    c, g = both("matmul", [a, b], [(3, 17, 9)], {})
    close(g, f64(c), dtype, 40, np.matmul(np.abs(f64(a)), np.abs(f64(b))))
    img, w, bias = rng.standard_normal((2, 3, 9, 8)).astype(dtype), rng.standard_normal((4, 3, 3, 3)).astype(dtype), rng.standard_normal(4).astype(dtype)
    c, g = both("conv2d", [img, w, bias], [(2, 4, 5, 8)], {"stride": [2, 1], "padding": 1})
    close(g, f64(c), dtype, 28, conv_reference(img, w, bias, (2, 1), (1, 1), (1, 1))[1])
    if dtype != "float64":
        u8 = rng.integers(0, 256, (2, 6, 5, 3), dtype=np.uint8)
        c, g = both("normalize", [u8], [(2, 3, 6, 5)], {"mean": [120.0, 110, 100], "std": [60.0, 55, 50], "layout": "NHWC", "out_layout": "NCHW"})
        close(g, f64(c), dtype, 4, np.abs(f64(c)) + 3)
    q, r = rng.integers(-128, 128, (5, 300)).astype(np.int8), rng.integers(-128, 128, (300, 7)).astype(np.int8)
    c, g = both("matmul", [q, r], [(5, 7)], {}, "int32")
    assert np.array_equal(c, g)
