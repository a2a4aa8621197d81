"""A daemon inside the consumer's own process, and zero-copy access to its device memory.

The training loop that consumes batches usually lives in the process that
owns the GPU. `serve_in_process()` runs the daemon there, on its own trio
thread, and `device_array()` hands the daemon's memory to the consumer
without a copy: the object exposes `__dlpack__` (PyTorch, JAX, NumPy, CuPy
all take it) and, on a GPU, `__cuda_array_interface__`.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import trio

from .. import errors as E
from ..addressing import OFFSET_MASK, SegmentKind
from ..kernels import shape_tuple
from ._config import DaemonConfig
from ._daemon import serve
from ._placement import VirtualDevice
from ._server import Server

__all__ = ["EmbeddedDaemon", "serve_in_process", "DeviceView"]


class DeviceView:
    """A zero-copy view of daemon memory, for frameworks that speak DLPack.

    The daemon's device work is queued on streams, so every export
    (`__dlpack__`, `__dlpack_device__`, `__cuda_array_interface__`,
    `__array__`) first waits for the work queued on the devices that can write
    this memory: the consumer never sees bytes a queued copy has yet to land.
    The other direction is the consumer's to order: a write the daemon does
    later is not fenced against the consumer's reads. Read (or finish the
    kernels that read) the view, then submit the next write into that memory.
    """

    def __init__(self, array: Any, keepalive: Any, ready: Callable[[], None] = lambda: None) -> None:
        self.array = array  # numpy.ndarray (CPU devices) or cupy.ndarray (GPUs)
        self._keepalive = keepalive
        self._ready = ready  # waits for the queued device work that writes this memory

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> Any:
        return self.array.dtype

    def __dlpack__(self, *args: Any, **kwargs: Any) -> Any:
        # `stream` (and max_version, dl_device, copy) go to the array: the consumer's stream is
        # then ordered after the array's; the daemon's own streams were waited for just now.
        self._ready()
        return self.array.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self) -> Any:
        self._ready()
        return self.array.__dlpack_device__()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if not isinstance(self.array, np.ndarray):
            raise TypeError("GPU memory: use DLPack or __cuda_array_interface__, not __array__")
        self._ready()
        return self.array if dtype is None else self.array.astype(dtype)

    def __getattr__(self, name: str) -> Any:
        if name == "__cuda_array_interface__":
            cai = self.array.__cuda_array_interface__  # AttributeError for host memory, as it should be
            self._ready()
            return cai
        raise AttributeError(name)

    def __repr__(self) -> str:
        return f"<DeviceView {self.shape} {self.dtype} on {type(self.array).__module__.split('.')[0]}>"


class EmbeddedDaemon:
    """A running daemon on a background thread of this process."""

    def __init__(self, config: DaemonConfig, owned_dir: Path | None = None) -> None:
        self.config = config
        self._owned_dir = owned_dir  # a private socket directory we made, removed on close
        self._started = threading.Event()
        self._server: Server | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="transferd-embedded", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    @property
    def endpoint(self) -> str:
        return self.config.endpoints[0]

    @property
    def server(self) -> Server:
        assert self._server is not None
        return self._server

    def _run(self) -> None:
        async def main() -> None:
            self._token = trio.lowlevel.current_trio_token()
            self._stop = trio.Event()
            async with trio.open_nursery() as nursery:
                self._server = await nursery.start(lambda task_status: serve(self.config, task_status=task_status, stop=self._stop))
                self._started.set()

        try:
            trio.run(main)
        except BaseException as exc:  # surfaced to the constructor or to close()
            self._error = exc
        finally:
            self._started.set()

    def device_array(self, resource: Any, shape: int | Sequence[int], dtype: Any = np.uint8, offset: int = 0) -> DeviceView:
        """Daemon memory (a device buffer or segment, by object or VA) as a zero-copy array view."""
        va = resource if isinstance(resource, int) else resource.va
        seg = self.server.table.get(va >> 40)
        if seg is None:
            raise E.UnknownSegment(f"VA {va:#x}: no such segment (freed?)")
        dt = np.dtype(dtype)
        shape_t = shape_tuple(shape)
        start = (va & OFFSET_MASK) + offset
        n = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
        if start < 0 or start + n > seg.nbytes:
            raise E.OutOfBounds(f"view of {n} bytes at offset {start} exceeds segment {seg.id} ({seg.nbytes} bytes)")
        if start % dt.itemsize:
            # A consumer's kernels load whole elements: misaligned, a GPU faults and loses its context.
            raise E.InvalidField(f"a {dt} view must start at a multiple of {dt.itemsize} bytes, not at offset {start}")
        base = seg.handle.array if seg.kind == SegmentKind.HOST else seg.handle
        arr = base[start : start + n].view(dt).reshape(shape_t)
        # Device memory is written by work queued on its own device; host memory by any
        # device's queued device-to-host copies.
        owners = self.server.devices if seg.kind == SegmentKind.HOST else [self.server.devices[seg.device]]
        return DeviceView(arr, keepalive=seg.handle, ready=lambda: _synchronize(owners))

    def close(self) -> None:
        """Drain (finish in-flight requests), release everything, stop the thread."""
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(30)
        if self._owned_dir is not None:
            shutil.rmtree(self._owned_dir, ignore_errors=True)
            self._owned_dir = None
        if self._error is not None:
            raise self._error

    def __enter__(self) -> "EmbeddedDaemon":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _synchronize(devices: Sequence[VirtualDevice]) -> None:
    """Wait for the work queued on `devices` (a no-op on NumPy devices)."""
    for dev in devices:
        try:
            dev.backend.synchronize_device(dev.local_id)
        except Exception as exc:  # a failed device: its memory has no defined contents to export
            raise E.BackendError(f"exporting a view: waiting for {dev}'s queued work failed: {type(exc).__name__}: {exc}") from exc


def serve_in_process(
    endpoint: str | None = None,
    *,
    backend: str = "auto",
    devices: int = 1,
    shm_dir: str | Path | None = None,
    **overrides: Any,
) -> EmbeddedDaemon:
    """Start a daemon on a thread of this process (default: a private temporary ipc endpoint)."""
    import os
    import tempfile

    owned = None
    if endpoint is None:
        owned = Path(tempfile.mkdtemp(prefix="transferd-"))
        os.chmod(owned, 0o700)
        endpoint = f"ipc://{owned}/transferd.sock"
    # Busy-polling rings would hold this process's GIL against the clients in its other
    # threads: an embedded daemon sleeps on the doorbell at once (pass ring_spin_s to change).
    overrides.setdefault("ring_spin_s", 0.0)
    cfg = replace(DaemonConfig(), endpoints=(endpoint,), backend=backend, devices=devices, **overrides)
    if shm_dir is not None:
        cfg = replace(cfg, shm_dir=Path(shm_dir))
    try:
        return EmbeddedDaemon(cfg, owned)
    except BaseException:
        if owned is not None:
            shutil.rmtree(owned, ignore_errors=True)
        raise
