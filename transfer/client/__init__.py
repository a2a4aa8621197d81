"""Clients for producers: blocking (`connect`), trio (`open_client`) and asyncio
(`open_asyncio_client`), one API over one core."""

from ._asyncio import AsyncioClient, AsyncioPending, open_asyncio_client
from .._pending import Pending
from ._pool import Slot, SlotPool
from ._remote import RemoteSegment
from ._resources import DeviceBuffer, HostSegment, SharedSegment
from ._sync import Client, connect
from ._trio import TrioClient, TrioPending, open_client

__all__ = ["Client", "connect", "TrioClient", "TrioPending", "open_client", "AsyncioClient", "AsyncioPending", "open_asyncio_client", "HostSegment", "DeviceBuffer", "SharedSegment", "RemoteSegment", "Pending", "Slot", "SlotPool"]
