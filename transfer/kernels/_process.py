"""The CPU device process's side (`backends/_devproc.py` is the daemon's): map the memory the
daemon sends, run its kernels, answer with their outcomes, until the socket closes.

It imports only what kernels need: NumPy, the registry, the errors. Not the package's
`__init__` (clients, the server, zmq, trio: about a second of imports on a busy machine),
which `process_argv`'s bootstrap skips by naming the package's directory as an empty
package before importing this module from it.
"""

from __future__ import annotations

import array
import mmap
import os
import pickle
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .. import errors as E
from ._layers import fuse_steps
from ._registry import REGISTRY
from ._steps import run_steps
from ._tensors import DTYPES

__all__ = ["MAX_MESSAGE", "process_argv", "serve"]

#: The largest message either way (a run's steps; a graph has at most 256 nodes).
MAX_MESSAGE = 1 << 20

_BOOT = (
    "import sys, types\n"
    "pkg = types.ModuleType('transfer'); pkg.__path__ = [sys.argv[1]]; sys.modules['transfer'] = pkg\n"
    "from transfer.kernels._process import main; main(int(sys.argv[2]))\n"
)


def process_argv(fd: int) -> list[str]:
    """The command that starts a device process serving the socket `fd` (inherited)."""
    return [sys.executable, "-c", _BOOT, str(Path(__file__).resolve().parent.parent), str(fd)]


def main(fd: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when this process ends
    serve(socket.socket(fileno=fd))


def serve(sock: socket.socket) -> None:
    """Messages (pickles, from the daemon only: the socket is one end of its socketpair):
    ``("map", key, nbytes)`` with the memfd, ``("unmap", key)``, and ``("run", steps,
    failed)``, answered with `run_steps`' outcomes. Steps name kernels by (operator,
    signature, device kind) and operands by (key, offset, shape, dtype, strides); a run's
    are bound to views first and fused as the ring worker fuses them (`fuse_steps`)."""
    maps: dict[int, np.ndarray] = {}
    kernels: dict[Any, Any] = {}

    def views(operands: list[Any]) -> list[np.ndarray]:
        out = []
        for key, off, shape, dtype, strides in operands:
            base = maps.get(key)
            if base is None:
                raise E.SegmentFreed("the memory was freed while the request ran")
            out.append(np.ndarray(shape, DTYPES[dtype], base, off, strides))
        return out

    def bind(step: Any) -> Any:
        """A step with its kernel and its operands' views; one that cannot be bound (memory
        gone, no such kernel) fails as its node when it runs, as any kernel's error does."""
        i, kernel, ins, outs, params, deps, name = step
        try:
            k = kernels.get(kernel)
            if k is None:
                k = kernels[kernel] = REGISTRY.get(*kernel)
                if k is None:
                    raise E.BackendError(f"no {kernel[2]} kernel {kernel[0]} for {kernel[1]}")
            return (i, k, views(ins), views(outs), params, deps, name)
        except Exception as exc:  # noqa: BLE001 - raised again by the step, where run_steps reports it
            return (i, _Unbound(exc), ins, outs, params, deps, name)

    def compute(kernel: Any, ins: list[Any], outs: list[Any], params: Any) -> Any:
        return kernel.run(ins, outs, params, np)

    buf = bytearray(MAX_MESSAGE)  # (received into: a fresh 1 MiB buffer per message costs ~50 us)
    fd_space = socket.CMSG_SPACE(array.array("i").itemsize)
    while True:
        try:
            n, anc, _, _ = sock.recvmsg_into([buf], fd_space)
        except OSError:
            return
        if not n:
            return
        fds = [fd for level, kind, data in anc if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
               for fd in array.array("i", data[: len(data) - len(data) % 4])]
        kind, *rest = pickle.loads(memoryview(buf)[:n])
        if kind == "map":
            key, nbytes = rest
            try:
                mm = mmap.mmap(fds[0], max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                for fd in fds:
                    os.close(fd)
            maps[key] = np.frombuffer(mm, np.uint8, count=nbytes)
        elif kind == "unmap":
            maps.pop(rest[0], None)  # unmapped when no view is left
        else:
            steps, failed = rest
            # (bound first, so that a linear and its in-place relu run as one: `fuse_steps`)
            sock.send(pickle.dumps(run_steps(fuse_steps([bind(s) for s in steps]), failed, compute), 5))


class _Unbound:
    """A step that could not be bound: running it raises why."""

    op, sig = "", ()

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def run(self, ins: Any, outs: Any, params: Any, xp: Any) -> None:
        raise self.exc
