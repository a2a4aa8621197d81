"""The GPU path through a real daemon: on a CUDA device when there is one (`-m gpu`), and on
the stream simulation everywhere (same `StreamBackend` code, CUDA's ordering rules checked).

Placement is forced (`--size-threshold 0`): every request whose operands allow it runs on
the GPU, never on the CPU virtual device, so these tests exercise the device path.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator

import numpy as np
import pytest

import transfer
from transfer._checksum import checksum64

GPU_BACKENDS = ["streamsim", pytest.param("cupy", marks=pytest.mark.gpu)]


@pytest.fixture(params=GPU_BACKENDS)
def gpud(request: pytest.FixtureRequest, daemon_factory: Any) -> Iterator[Any]:
    # 64 KiB: larger passes go to a worker (where segments get pinned), smaller run inline.
    yield daemon_factory("--backend", request.param, "--size-threshold", "0", "--inline-bytes", "64K")


def gpu_batches(c: transfer.Client) -> int:
    return sum(d["batches"] for d in c.stats()["daemon"]["devices"] if d["kind"] == "gpu")


def test_host_to_device_dmas_from_the_pinned_producer_segment(gpud: Any) -> None:
    """The producer's segment is page-locked in place (registered, no staging copy) by the
    first large copy, and the bytes that reach the device are the producer's."""
    with transfer.connect(gpud.endpoint) as c:
        n = 8 << 20
        data = np.random.default_rng(1).integers(0, 256, n, dtype=np.uint8)
        seg, back, dev = c.segment(n), c.segment(n), c.alloc(n)
        seg.buffer[:] = data
        before = gpu_batches(c)
        c.copy(dev, seg.va, n).result(30)
        stats = c.stats()["daemon"]
        assert stats["pinned_bytes"] >= n  # this segment, registered with the driver
        assert gpu_batches(c) > before  # it ran on the GPU, not the CPU device
        assert c.checksum(dev, n).result(30) == checksum64(data)
        c.copy(back.va, dev, n).result(30)
        assert (back.buffer == data).all()
        c.copy(dev.va + 4096, seg.va + 8192, 4096).result(30)  # small: inline, from the loop
        c.copy(back.va, dev.va, 16384).result(30)
        assert (back.buffer[4096:8192] == data[8192:12288]).all() and (back.buffer[:4096] == data[:4096]).all()


def test_compute_runs_on_the_gpu_and_matches_numpy(gpud: Any) -> None:
    with transfer.connect(gpud.endpoint) as c:
        x = np.random.default_rng(2).integers(0, 256, (8, 4, 32, 32), dtype=np.uint8)
        seg = c.segment(x.nbytes + 4 * x.nbytes)
        seg.ndarray(x.shape, np.uint8)[:] = x
        din, dout = c.alloc(x.nbytes), c.alloc(4 * x.nbytes)
        c.copy(din, seg.va, x.nbytes)
        mean, std = [120.0, 110.0, 100.0, 90.0], [60.0, 55.0, 50.0, 45.0]
        before = gpu_batches(c)
        c.compute("normalize", [transfer.TensorRef(din.va, "uint8", x.shape)], [transfer.TensorRef(dout.va, "float32", x.shape)],
                  {"mean": mean, "std": std}).result(30)
        assert gpu_batches(c) > before
        c.copy(seg.va + x.nbytes, dout, 4 * x.nbytes).result(30)
        y = seg.ndarray(x.shape, np.float32, offset=x.nbytes)
        want = (x.astype(np.float32) - np.float32(mean).reshape(1, 4, 1, 1)) / np.float32(std).reshape(1, 4, 1, 1)
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


def test_a_host_input_is_read_on_the_stream_before_later_host_writes(gpud: Any) -> None:
    """A compute reads a host input by a copy queued on the stream (DMA from the segment, not
    a snapshot taken when it is queued). A host-to-host copy later in the same batch that
    overwrites that input must wait for the read; each answer reflects its own input."""
    shape = (4, 4, 16, 16)
    n = int(np.prod(shape))
    mean, std = [10.0, 20.0, 30.0, 40.0], [2.0, 4.0, 5.0, 8.0]
    rng = np.random.default_rng(4)

    def want(x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float32) - np.float32(mean).reshape(1, 4, 1, 1)) / np.float32(std).reshape(1, 4, 1, 1)

    with transfer.connect(gpud.endpoint) as c:
        seg = c.segment(2 * n + 4 * n)
        a, b = seg.ndarray(shape, np.uint8), seg.ndarray(shape, np.uint8, offset=n)
        out = c.alloc(4 * n)
        for _ in range(4):
            xa, xb = rng.integers(0, 256, shape, dtype=np.uint8), rng.integers(0, 256, shape, dtype=np.uint8)
            a[...], b[...] = xa, xb
            with c.batch():
                done = c.compute("normalize", [transfer.TensorRef(seg.va, "uint8", shape)],
                                 [transfer.TensorRef(out.va, "float32", shape)], {"mean": mean, "std": std})
                c.copy(seg.va, seg.va + n, n)  # a's bytes become b's, after the compute read them
                back = c.copy(seg.va + 2 * n, out, 4 * n)
            done.result(30)
            back.result(30)
            np.testing.assert_allclose(seg.ndarray(shape, np.float32, offset=2 * n), want(xa), rtol=1e-5, atol=1e-5)
            assert np.array_equal(a, xb)


def test_pipelined_passes_are_answered_only_once_done(gpud: Any) -> None:
    """Groups of copies in, and back out, through 8 slots: each group's answer means its
    bytes are on the host (the daemon queued the next groups behind it meanwhile)."""
    size, slots = 256 << 10, 8
    rng = np.random.default_rng(3)
    with transfer.connect(gpud.endpoint, ring=True) as c:
        seg, dev, back = c.segment(size * slots), c.alloc(size * slots), c.segment(size * slots)
        pending: list[Any] = [None] * slots
        want: list[Any] = [None] * slots
        for seq in range(96):
            k = seq % slots
            if pending[k] is not None:
                pending[k].result(30)
                assert checksum64(back.buffer[k * size : (k + 1) * size]) == want[k]
            data = rng.integers(0, 256, size, dtype=np.uint8)
            seg.buffer[k * size : (k + 1) * size] = data
            want[k] = checksum64(data)
            with c.batch():
                c.copy(dev.va + k * size, seg.va + k * size, size)
                pending[k] = c.copy(back.va + k * size, dev.va + k * size, size)
        c.fence()
        assert all(checksum64(back.buffer[k * size : (k + 1) * size]) == want[k] for k in range(slots))
        assert c.stats()["daemon"]["pipelined_passes"] > 0


def test_two_tenants_on_their_own_streams_at_once(gpud: Any) -> None:
    """Two sessions, each on several streams (its lanes), copying through the GPU at the same
    time: each gets exactly its own bytes back."""
    errors: list[BaseException] = []

    def tenant(seed: int) -> None:
        try:
            n = 4 << 20
            data = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
            with transfer.connect(gpud.endpoint, ring=bool(seed % 2)) as c:
                seg, back, dev = c.segment(n), c.segment(n), c.alloc(n)
                seg.buffer[:] = data
                for rnd in range(8):
                    piece = n // 8
                    with c.batch():
                        for k in range(8):
                            c.copy(dev.va + k * piece, seg.va + ((k + rnd) % 8) * piece, piece, stream=k)
                    c.copy(back.va, dev.va, n, stream=rnd).result(30)
                    want = np.roll(data.reshape(8, piece), -rnd, axis=0).reshape(-1)
                    assert (back.buffer == want).all()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=tenant, args=(s,)) for s in (10, 11)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
