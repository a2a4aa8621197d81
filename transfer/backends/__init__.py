"""Device backends behind one small interface (see _base.Backend)."""

from __future__ import annotations

import os

from ._base import Backend, Span
from ._numpy import NumpyBackend

__all__ = ["Backend", "Span", "NumpyBackend", "make_backend", "STREAMSIM_DEVICES_ENV"]

#: Test-only: how many simulated GPUs `--backend streamsim` has (default 1).
STREAMSIM_DEVICES_ENV = "TRANSFER_STREAMSIM_DEVICES"


def make_backend(name: str = "auto", devices: int = 1) -> Backend:
    """`numpy`, `cupy`, or `auto` (CuPy only if a device actually allocates).

    `streamsim` is for tests: a simulated GPU with CUDA stream semantics in host RAM
    (`_streamsim`); it checks ordering, it is not fast.
    """
    if name == "numpy":
        return NumpyBackend(devices)
    if name == "streamsim":
        from ._streamsim import StreamSimBackend

        return StreamSimBackend(_streamsim_devices())
    if name in ("cupy", "auto"):
        try:
            from ._cupy import CupyBackend  # lazy: importing CuPy is slow and may lack a driver
        except ImportError as exc:
            if name == "cupy":
                raise RuntimeError(f"--backend cupy needs CuPy (pip install 'transfer[gpu]'): {exc}") from None
            return NumpyBackend(devices)
        usable, why = CupyBackend.probe()
        if usable:
            return CupyBackend()
        if name == "cupy":
            raise RuntimeError(f"--backend cupy: no usable CUDA device ({why})")
        return NumpyBackend(devices)
    raise ValueError(f"unknown backend {name!r} (choose auto, cupy, numpy or streamsim)")


def _streamsim_devices() -> int:
    raw = os.environ.get(STREAMSIM_DEVICES_ENV, "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise ValueError(f"{STREAMSIM_DEVICES_ENV}={raw!r}: expected a whole number of simulated GPUs in 1..64")
    return n
