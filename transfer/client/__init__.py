"""Clients for producers: blocking (`connect`) and trio (`open_client`)."""

from ._core import DeviceBuffer, HostSegment, Pending, SharedSegment
from ._pool import Slot, SlotPool
from ._sync import Client, connect
from ._trio import TrioClient, TrioPending, open_client

__all__ = ["Client", "connect", "TrioClient", "TrioPending", "open_client", "HostSegment", "DeviceBuffer", "SharedSegment", "Pending", "Slot", "SlotPool"]
