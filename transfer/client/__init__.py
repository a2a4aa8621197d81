"""Clients for producers: blocking (`connect`), trio (`open_client`) and asyncio
(`open_asyncio_client`), one API over one core."""

from typing import TYPE_CHECKING, Any

from .._pending import Pending
from ._pool import Slot, SlotPool
from ._remote import RemoteSegment
from ._resources import DeviceBuffer, HostSegment, SharedSegment
from ._sync import Client, connect
from ._trio import TrioClient, TrioPending, open_client

__all__ = ["Client", "connect", "TrioClient", "TrioPending", "open_client", "AsyncioClient", "AsyncioPending", "open_asyncio_client", "HostSegment", "DeviceBuffer", "SharedSegment", "RemoteSegment", "Pending", "Slot", "SlotPool"]

if TYPE_CHECKING:
    from ._asyncio import AsyncioClient, AsyncioPending, open_asyncio_client

#: Loaded on first use: importing asyncio costs a process (the daemon, a trio or a blocking
#: client) about 37 ms of its start that it never needs.
_ASYNCIO = ("AsyncioClient", "AsyncioPending", "open_asyncio_client")


def __getattr__(name: str) -> Any:
    if name in _ASYNCIO:
        from . import _asyncio

        return getattr(_asyncio, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
