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
