"""Every operator through a real daemon, on every backend, against NumPy in this process."""

from __future__ import annotations

import numpy as np
import pytest

import transfer

RNG = np.random.default_rng(7)


@pytest.fixture
def client(backend_daemon):
    with transfer.connect(backend_daemon.endpoint) as c:
        yield c


def host(c, arr: np.ndarray):
    """A segment holding `arr` and its tensor reference."""
    seg = c.segment(max(arr.nbytes, 1))
    view = seg.ndarray(arr.shape, arr.dtype)
    view[...] = arr
    return seg, view, seg.tensor(arr.shape, arr.dtype)


def out(c, shape, dtype):
    seg = c.segment(max(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, 1))
    return seg.ndarray(shape, dtype), seg.tensor(shape, dtype)


@pytest.mark.parametrize("dtype", ["uint8", "int32", "float32", "float64"])
def test_fill_and_cast(client, dtype: str) -> None:
    y, yt = out(client, (3, 5), dtype)
    client.compute("fill", [], [yt], {"value": 7}).result()
    assert (y == 7).all()
    _, x, xt = host(client, RNG.integers(0, 100, (3, 5)).astype(dtype))
    z, zt = out(client, (3, 5), "float16")
    client.compute("cast", [xt], [zt]).result()
    assert np.array_equal(z, x.astype(np.float16))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_scale_add_in_place_and_not(client, dtype: str) -> None:
    seg, x, xt = host(client, RNG.standard_normal((64, 3)).astype(dtype))
    y, yt = out(client, (64, 3), dtype)
    client.compute("scale_add", [xt], [yt], {"a": 2.5, "b": -1.0}).result()
    np.testing.assert_allclose(y, x * 2.5 - 1.0, rtol=1e-6)
    before = x.copy()
    client.compute("scale_add", [xt], [xt], {"a": 0.5}).result()  # exactly in place: allowed
    np.testing.assert_allclose(x, before * 0.5, rtol=1e-6)


@pytest.mark.parametrize("op", ["sum", "mean"])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_reductions(client, op: str, axis) -> None:
    _, x, xt = host(client, RNG.standard_normal((6, 7, 8)).astype(np.float64))
    want = getattr(x, op)(axis=axis)
    y, yt = out(client, np.shape(want), "float64")
    client.compute(op, [xt], [yt], {"axis": axis}).result()
    np.testing.assert_allclose(y, want, rtol=1e-12)


def test_matmul_on_a_device_buffer(client) -> None:
    a = RNG.standard_normal((32, 16)).astype(np.float32)
    b = RNG.standard_normal((16, 8)).astype(np.float32)
    _, _, at = host(client, a)
    _, _, bt = host(client, b)
    dev = client.alloc(32 * 8 * 4)
    client.compute("matmul", [at, bt], [dev.tensor((32, 8), np.float32)]).result()
    back, backt = out(client, (32, 8), np.float32)
    client.copy(backt.va, dev.va, dev.nbytes).result()
    np.testing.assert_allclose(back, a @ b, rtol=1e-4, atol=1e-5)


def test_normalize_image_batch(client) -> None:
    _, x, xt = host(client, RNG.integers(0, 256, (4, 3, 16, 16), dtype=np.uint8))
    y, yt = out(client, (4, 3, 16, 16), np.float32)
    mean, std = [123.7, 116.3, 103.5], [58.4, 57.1, 57.4]
    client.compute("normalize", [xt], [yt], {"mean": mean, "std": std}).result()
    want = (x.astype(np.float32) - np.float32(mean).reshape(1, 3, 1, 1)) / np.float32(std).reshape(1, 3, 1, 1)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_checksum_and_strided_views(client) -> None:
    seg, x, xt = host(client, RNG.integers(0, 256, (8, 8), dtype=np.uint8))
    assert client.compute("checksum", [xt]).result() == transfer.checksum64(x)
    col = seg.tensor((8,), np.uint8, offset=3, strides=(8,))  # column 3, strided
    y, yt = out(client, (8,), np.float32)
    client.compute("cast", [col], [yt]).result()
    assert np.array_equal(y, x[:, 3].astype(np.float32))


def test_bad_compute_requests_fail_clearly(client) -> None:
    seg, x, xt = host(client, np.zeros((4, 4), np.float32))
    with pytest.raises(transfer.UnknownOperation, match="known:"):
        client.compute("fft", [xt], [xt]).result()
    with pytest.raises(transfer.InvalidField, match="supported dtypes"):
        y, yt = out(client, (), "int8")
        _, _, it = host(client, np.zeros((4, 4), np.int8))
        client.compute("mean", [it], [yt]).result()
    with pytest.raises(transfer.InvalidField, match="shape"):
        y, yt = out(client, (3,), np.float32)
        client.compute("sum", [xt], [yt], {"axis": 0}).result()
    with pytest.raises(transfer.InvalidField, match="overlaps"):
        client.compute("cast", [xt], [seg.tensor((4, 4), np.float32, offset=0, strides=(4, 16))]).result()
    with pytest.raises(transfer.OutOfBounds):
        client.compute("scale_add", [xt], [transfer.TensorRef(seg.va + 8, "float32", (4, 4))]).result()
    with pytest.raises(transfer.InvalidField, match="takes 2 input"):
        client.compute("matmul", [xt], [xt]).result()
    with pytest.raises(transfer.InvalidField, match="normalize"):
        client.compute("normalize", [xt], [xt], {"mean": [1], "std": [1]}).result()
    with pytest.raises(transfer.InvalidField):
        client.compute("scale_add", [xt], [xt], {"a": "two"}).result()
    # The session still works.
    assert client.compute("checksum", [xt]).result() == transfer.checksum64(x)


# --- layers and preprocessing through the daemon (the hypothesis suite: tests/unit/kernels/test_kernels.py) ----
def test_mlp_layers_and_bfloat16_through_the_daemon(client) -> None:
    """linear -> gelu -> layer_norm -> linear -> softmax, each a compute request by VA, in
    float32 and bfloat16 (computed in float32, stored rounded)."""
    import ml_dtypes

    for dt, tol in ((np.float32, 1e-5), (ml_dtypes.bfloat16, 3e-2)):
        x = RNG.standard_normal((16, 12)).astype(dt)
        w1, b1 = (RNG.standard_normal((24, 12)) / 4).astype(dt), RNG.standard_normal(24).astype(dt)
        g, beta = RNG.standard_normal(24).astype(dt), RNG.standard_normal(24).astype(dt)
        w2, b2 = (RNG.standard_normal((5, 24)) / 4).astype(dt), RNG.standard_normal(5).astype(dt)
        ts = [host(client, a)[2] for a in (x, w1, b1, g, beta, w2, b2)]
        h, ht = out(client, (16, 24), dt)
        z, zt = out(client, (16, 24), dt)
        lo, lot = out(client, (16, 5), dt)
        p, pt = out(client, (16, 5), dt)
        client.compute("linear", ts[0:3], [ht]).result()
        client.compute("gelu", [ht], [ht]).result()  # in place
        client.compute("layer_norm", [ht, ts[3], ts[4]], [zt], {"eps": 1e-5}).result()
        client.compute("linear", [zt, ts[5], ts[6]], [lot]).result()
        client.compute("softmax", [lot], [pt], {"axis": -1}).result()
        f = lambda a: np.asarray(a, np.float64)  # noqa: E731
        import math

        r = f(x) @ f(w1).T + f(b1)
        r = 0.5 * r * (1 + np.vectorize(math.erf)(r / math.sqrt(2)))
        r = (r - r.mean(-1, keepdims=True)) / np.sqrt(r.var(-1, keepdims=True) + 1e-5) * f(g) + f(beta)
        r = r @ f(w2).T + f(b2)
        e = np.exp(r - r.max(-1, keepdims=True))
        np.testing.assert_allclose(f(p), e / e.sum(-1, keepdims=True), atol=tol)


def test_batched_matmul_int8_and_conv2d(client) -> None:
    a = RNG.integers(-128, 128, (2, 1, 7, 300)).astype(np.int8)
    b = RNG.integers(-128, 128, (3, 300, 4)).astype(np.int8)
    y, yt = out(client, (2, 3, 7, 4), np.int32)
    client.compute("matmul", [host(client, a)[2], host(client, b)[2]], [yt]).result()
    assert np.array_equal(y, np.matmul(a.astype(np.int64), b.astype(np.int64)))
    x = RNG.standard_normal((2, 3, 10, 9)).astype(np.float32)
    w = RNG.standard_normal((4, 3, 3, 3)).astype(np.float32)
    bias = RNG.standard_normal(4).astype(np.float32)
    y, yt = out(client, (2, 4, 5, 9), np.float32)
    ts = [host(client, v)[2] for v in (x, w, bias)]
    client.compute("conv2d", ts, [yt], {"stride": [2, 1], "padding": 1}).result()
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.stack([np.stack([np.einsum("nckl,ockl->no", xp[:, :, 2 * i : 2 * i + 3, j : j + 3], w) for j in range(9)], -1) for i in range(5)], -2)
    np.testing.assert_allclose(y, want + bias.reshape(1, 4, 1, 1), rtol=1e-4, atol=1e-4)


def test_image_preprocessing_hwc_uint8_to_chw_float16(client) -> None:
    """crop, flip, then normalize NHWC uint8 -> NCHW float16 in one pass."""
    seg, x, xt = host(client, RNG.integers(0, 256, (2, 20, 24, 3), dtype=np.uint8))
    c, ct = out(client, (2, 16, 16, 3), np.uint8)
    client.compute("crop", [xt], [ct], {"start": [0, 2, 4, 0]}).result()
    f, ft = out(client, (2, 16, 16, 3), np.uint8)
    client.compute("flip", [ct], [ft], {"axes": [2]}).result()
    y, yt = out(client, (2, 3, 16, 16), np.float16)
    mean, std = [123.7, 116.3, 103.5], [58.4, 57.1, 57.4]
    client.compute("normalize", [ft], [yt], {"mean": mean, "std": std, "layout": "NHWC", "out_layout": "NCHW"}).result()
    want = (x[:, 2:18, 4:20, :][:, :, ::-1, :].astype(np.float64) - mean) / std
    np.testing.assert_allclose(y.astype(np.float64), want.transpose(0, 3, 1, 2), rtol=2e-3, atol=2e-3)
    t, tt = out(client, (2, 3, 16, 16), np.uint8)
    client.compute("transpose", [ft], [tt], {"axes": [0, 3, 1, 2]}).result()
    assert np.array_equal(t, f.transpose(0, 3, 1, 2))


def test_wire_parameters_are_validated(client) -> None:
    _, _, xt = host(client, np.zeros((4, 6), np.float32))
    _, wt = out(client, (5, 6), np.float32)
    _, bt = out(client, (5,), np.float32)
    _, yt = out(client, (4, 5), np.float32)
    bad = [
        ("linear", [xt, xt, bt], [yt], {}, "weight"),  # weight (4, 6): not (N, K) for this output
        ("linear", [xt, wt, bt], [xt], {}, "output must have shape"),
        ("matmul", [xt, xt], [yt], {}, r"\(\.\.\., M, K\)"),
        ("softmax", [xt], [xt], {"axis": 2}, "out of range"),
        ("gelu", [xt], [xt], {"approximate": "fast"}, "approximate"),
        ("layer_norm", [xt, bt, bt], [xt], {}, "trailing shape"),
        ("layer_norm", [xt, xt, xt], [xt], {"eps": float("nan")}, "finite"),
        ("conv2d", [xt, wt, bt], [yt], {}, "needs x"),
        ("crop", [xt], [yt], {"start": [0, 3]}, "not inside"),
        ("crop", [xt], [yt], {"start": [0]}, "one per dimension"),
        ("flip", [xt], [xt], {"axes": [0, 0]}, "repeats"),
        ("transpose", [xt], [xt], {"axes": [0]}, "each of the 2 axes"),
        ("normalize", [xt], [xt], {"mean": [0], "std": [1], "layout": "HWC"}, "needs 3 dimensions"),
        ("relu", [xt], [bt], {}, "shapes differ"),
    ]
    for op, ins, outs, params, msg in bad:
        with pytest.raises(transfer.InvalidField, match=msg):
            client.compute(op, ins, outs, params).result()
    _, _, it = host(client, np.zeros((4, 6), np.int8))
    with pytest.raises(transfer.InvalidField, match=r"no \w+ kernel for \(int8, int8\) -> \(float32\); supported dtypes"):
        client.compute("matmul", [it, transfer.TensorRef(it.va, "int8", (6, 4))], [out(client, (4, 4), np.float32)[1]]).result()
    assert client.compute("checksum", [xt]).result() == transfer.checksum64(np.zeros((4, 6), np.float32))


def test_a_gpu_without_the_dtype_falls_back_only_for_host_operands(client) -> None:
    """bfloat16 -> int32 has no GPU kernel: cast (a light operator) runs on a CPU device when its
    operands are host memory, and is refused, saying why, when one is GPU memory."""
    import ml_dtypes

    _, x, xt = host(client, np.arange(-3, 5).astype(ml_dtypes.bfloat16))
    y, yt = out(client, (8,), np.int32)
    client.compute("cast", [xt], [yt]).result()
    assert y.tolist() == list(range(-3, 5))
    dev = client.alloc(16)
    if client.stats()["daemon"]["devices"][0]["kind"] != "gpu":
        return  # a CPU daemon has the kernel: nothing to fall back from
    with pytest.raises(transfer.InvalidField, match="cannot move there"):
        client.compute("cast", [transfer.TensorRef(dev.va, "bfloat16", (8,))], [yt]).result()
