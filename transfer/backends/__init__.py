"""Device backends behind one small interface (see _base.Backend)."""

from __future__ import annotations

import importlib.util
import logging
import os

from ._base import Answer, Backend, Span, Then
from ._devproc import Channel
from ._numpy import NumpyBackend

__all__ = ["Answer", "Backend", "Channel", "Span", "Then", "NumpyBackend", "make_backend", "select_backend", "STREAMSIM_DEVICES_ENV"]

log = logging.getLogger("transfer.backends")

#: Test-only: how many simulated GPUs `--backend streamsim` has (default 1).
STREAMSIM_DEVICES_ENV = "TRANSFER_STREAMSIM_DEVICES"


def make_backend(name: str = "auto", devices: int = 1) -> Backend:
    """`numpy`, `cupy`, or `auto` (CuPy only if a device actually allocates).

    `streamsim` is for tests: a simulated GPU with CUDA stream semantics in host RAM
    (`_streamsim`); it checks ordering, it is not fast.
    """
    return select_backend(name, devices)[0]


def select_backend(name: str = "auto", devices: int = 1) -> tuple[Backend, str]:
    """The backend `name` asks for, and why it is that one.

    The choice is logged (`transfer.backends`): INFO for what was chosen, WARNING
    when `auto` fell back from a CuPy that is installed but cannot run (a wrong
    driver or CUDA libraries missing deserves attention; no CuPy at all does not).
    """
    if name == "numpy":
        return _chose(NumpyBackend(devices), "asked for")
    if name == "streamsim":
        from ._streamsim import StreamSimBackend

        gpus = _streamsim_devices()
        return _chose(StreamSimBackend(gpus), f"asked for (a simulated GPU x{gpus}; tests only)")
    if name not in ("cupy", "auto"):
        raise ValueError(f"unknown backend {name!r} (choose auto, cupy, numpy or streamsim)")
    if importlib.util.find_spec("cupy") is None:
        why = "CuPy is not installed (pip install 'transfer[gpu]')"
        if name == "cupy":
            raise RuntimeError(f"--backend cupy: {why}")
        return _chose(NumpyBackend(devices), f"auto: {why}")
    try:
        from ._cupy import CupyBackend  # lazy: importing CuPy is slow and may lack a driver
    except ImportError as exc:
        if name == "cupy":
            raise RuntimeError(f"--backend cupy needs CuPy (pip install 'transfer[gpu]'): {exc}") from None
        return _chose(NumpyBackend(devices), f"auto: CuPy cannot be imported ({exc})", fell_back=True)
    usable, why = CupyBackend.probe()
    if usable:
        return _chose(CupyBackend(), f"{'auto: ' if name == 'auto' else ''}CuPy works ({why})")
    if name == "cupy":
        raise RuntimeError(f"--backend cupy: no usable CUDA device ({why})")
    return _chose(NumpyBackend(devices), f"auto: CuPy is installed but unusable ({why})", fell_back=True)


def _chose(backend: Backend, why: str, fell_back: bool = False) -> tuple[Backend, str]:
    log.log(logging.WARNING if fell_back else logging.INFO, "backend %s: %s", backend.name, why)
    return backend, why


def _streamsim_devices() -> int:
    raw = os.environ.get(STREAMSIM_DEVICES_ENV, "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise ValueError(f"{STREAMSIM_DEVICES_ENV}={raw!r}: expected a whole number of simulated GPUs in 1..64")
    return n
