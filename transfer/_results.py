"""What a successful reply carries, typed: declared once, built by the daemon, checked by the client.

A control request's result travels as a msgpack map. The daemon makes it
from one of these Structs (msgspec encodes a Struct as a map), and the
client turns what arrives back into the same Struct (`transfer.protocol.result`),
so every field of a reply is checked against its declared type and range as
a request's fields are: a missing key, a negative size, a NaN heartbeat or a
pid no kernel could hand out is a `MalformedFrame`, never a KeyError or a
later crash. Unknown keys are allowed (a newer daemon may say more); unknown
values are not.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ._fields import I32, PID_MAX, U32, U32_MAX, U64, Bin64, Str32, Str64, Str256
from .addressing import MAX_SEGMENT_ID

__all__ = [
    "Result", "WireLimits", "DeviceInfo", "Arena", "HelloResult", "Registered", "Allocated",
    "RemoteRegistered", "Shared", "Attached", "RingOpened", "ChannelOpened", "NodeProfile", "GraphProfile",
]

#: A handover token (`transport._fds.TOKEN_BYTES`).
Token = Annotated[bytes, Meta(min_length=16, max_length=16)]
#: A path the daemon names (its shm dir, its fd socket): PATH_MAX.
PathText = Annotated[str, Meta(min_length=1, max_length=4096)]
#: A period in seconds: positive and finite (msgspec refuses NaN against a bound).
Seconds = Annotated[float, Meta(gt=0, le=86400)]
Positive = Annotated[int, Meta(ge=1, le=1 << 40)]
DeviceIndex = Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]
Capacity = Annotated[int, Meta(ge=2, le=1 << 24)]  # a ring's slots (`_ring.MAX_CAPACITY`)
#: Segment ids in one arena: the daemon's `arena_ids` is at most this (a quarter of the id
#: space, so four sessions' arenas fit at once).
MAX_ARENA_IDS = 1 << 22


class Result(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=False):
    """A reply's result map."""


class WireLimits(Result):
    """`protocol.Limits` as hello announces it."""

    max_frame_bytes: Positive
    max_batch: Positive
    max_vector: Positive
    max_str: Positive
    max_bin: Positive


class DeviceInfo(Result):
    index: DeviceIndex
    kind: Str32
    backend: Str32


class Arena(Result):
    """A block of segment ids a session names its deferred allocations with, on one device."""

    device: DeviceIndex
    first_id: Annotated[int, Meta(ge=1, le=MAX_SEGMENT_ID)]
    count: Annotated[int, Meta(ge=1, le=MAX_ARENA_IDS)]
    quota: U64

    def __post_init__(self) -> None:
        if self.first_id + self.count - 1 > MAX_SEGMENT_ID:
            raise ValueError(f"an arena of {self.count} ids from {self.first_id} runs past the last segment id ({MAX_SEGMENT_ID})")


class HelloResult(Result):
    session: U64
    server_pid: Annotated[int, Meta(ge=1, le=PID_MAX)]  # (a daemon is a process: never pid 0)
    version: U32
    limits: WireLimits
    max_inflight: Annotated[int, Meta(ge=1, le=U32_MAX)]
    backend: dict[Str64, Any]
    devices: list[DeviceInfo]
    heartbeat_s: Seconds
    session_timeout_s: Seconds
    shm_dir: PathText
    fd_socket: PathText
    home_device: DeviceIndex
    arenas: list[Arena]


class Registered(Result):
    """RegisterHost: the segment, and the token that collects its memfd."""

    va: U64
    nbytes: U64
    token: Token


class Allocated(Result):
    va: U64
    nbytes: U64
    device: DeviceIndex


class RemoteRegistered(Result):
    va: U64
    nbytes: U64
    agent: Str256


class Shared(Result):
    token: Bin64


class Attached(Result):
    va: U64
    nbytes: U64
    kind: Literal["host", "device", "remote"]
    device: I32


class RingOpened(Result):
    """OpenRing: tokens for the ring's memfd, the daemon's doorbell and (asked for) the
    completion doorbell; the ring's geometry; what the daemon serves on it."""

    token: Token
    bell: Token
    cbell: Token | None
    capacity: Capacity
    completion_capacity: Capacity
    graphs: bool = False
    after: bool = False


class ChannelOpened(Result):
    """OpenChannel: where the session's data channel connects, and the one-time key it
    presents; the ring's geometry; what the daemon serves on it (as `RingOpened`)."""

    key: Token
    port: Annotated[int, Meta(ge=1, le=65535)]
    capacity: Capacity
    completion_capacity: Capacity
    graphs: bool = False
    after: bool = False


class NodeProfile(Result):
    node: U32
    op: Str64
    device: DeviceIndex
    kind: Str32
    kernel: Str256
    us: Annotated[float, Meta(ge=0)]


class GraphProfile(Result):
    """RunGraph with `profile`: each node's device, kernel and time."""

    nodes: list[NodeProfile]
