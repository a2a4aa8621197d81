"""transfer: zero-copy data transfer for GPU data pipelines.

Producers and the daemon share a mapping table of segments addressed by
64-bit virtual addresses (VAs); requests carry VAs and sizes, never payloads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__ as __version__

try:  # the native core: every part of the package needs it, so its absence is said at once
    from . import _native as _native
except ImportError as _exc:
    raise ImportError(
        f"transfer's native core (transfer._native) cannot be imported: {_exc}. It is built from native/*.c "
        "when the package is installed: reinstall with a C compiler and the Python headers (pip install "
        "--force-reinstall --no-binary transfer transfer; in a checkout: pip install -e .), or install a wheel "
        "built for this platform"
    ) from _exc

from ._checksum import checksum64
from .addressing import make_va, split_va
from .client import Client, DeviceBuffer, HostSegment, Pending, TrioClient, connect, open_client
from .client._deferred import Graph
from .kernels import OPERATORS, TensorRef
from .server import DeviceView, serve_in_process
from .errors import *  # noqa: F403  (the whole hierarchy is public)
from .errors import __all__ as _errors_all

__all__ = [
    "connect",
    "Client",
    "open_client",
    "TrioClient",
    "open_asyncio_client",
    "AsyncioClient",
    "HostSegment",
    "DeviceBuffer",
    "Pending",
    "checksum64",
    "TensorRef",
    "OPERATORS",
    "Graph",
    "serve_in_process",
    "DeviceView",
    "make_va",
    "split_va",
    *_errors_all,
]

if TYPE_CHECKING:
    from .client import AsyncioClient, open_asyncio_client


def __getattr__(name: str) -> Any:
    """The asyncio client, loaded on first use (see transfer.client)."""
    if name in ("AsyncioClient", "open_asyncio_client"):
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
