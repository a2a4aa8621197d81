"""Clients for producers: blocking (`connect`) and trio (`open_client`), one API over one core."""

from ._pending import Pending
from ._pool import Slot, SlotPool
from ._remote import RemoteSegment
from ._resources import DeviceBuffer, HostSegment, SharedSegment
from ._sync import Client, connect
from ._trio import TrioClient, TrioPending, open_client

__all__ = ["Client", "connect", "TrioClient", "TrioPending", "open_client", "HostSegment", "DeviceBuffer", "SharedSegment", "RemoteSegment", "Pending", "Slot", "SlotPool"]
