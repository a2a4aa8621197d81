"""Clients for producers: blocking (`connect`) and trio (`open_client`)."""

from ._core import DeviceBuffer, HostSegment, Pending
from ._sync import Client, connect

__all__ = ["Client", "connect", "HostSegment", "DeviceBuffer", "Pending"]
