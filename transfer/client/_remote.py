"""Client side of remote (NIXL) segments: the producer's own buffers, pulled or pushed by the daemon.

A producer on another host (or one that simply prefers its own memory)
registers a NumPy buffer with its NIXL agent and tells the daemon about it
(RegisterRemote: agent metadata + the buffer's descriptor list in the strict
`encode_descs` layout). The daemon maps it as a `remote` segment: its VAs can
be the source of a copy (one-sided READ into daemon memory) or the
destination (WRITE). The bytes never cross the control socket.

Order on release matters (docs/rdma.md: deregistration is not revocation):
the daemon drops the segment and acknowledges *before* the producer
deregisters or frees the memory. `RemoteSegment.free()` / `Client.free()`
does exactly that: the free travels with the client's next frame, as a
deferred buffer's does (a client without arenas sends an Unregister and
waits), and its answer, read with that frame's, deregisters the memory
(`ClientCore.after`). Registering the same memory again in between sends
the free and waits for its answer first.

Registration is deferred, as allocation is (`client._deferred`): `register_remote` registers
the memory with our agent, names it with a VA of the session's arena, and returns; the
RegisterRemote (with that VA, the partial metadata of this one registration and where the
user's code registered it) travels ahead of the first request that names the segment. So a
registration costs about what NIXL's own does, and a failure (the daemon refusing the
metadata, a quota) is the error of that first request, naming the line that registered.
A client without arenas (`deferred=False`) waits for the daemon's answer instead.

Registering the same memory again (the same address and size, while a registration of it is
live) is reused: the new `RemoteSegment` names the same daemon segment and NIXL registration,
at the cost of a lookup. Each is freed on its own; the last free lets the memory go.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Callable, Generator

import numpy as np

from .. import errors as E
from .. import protocol as P
from ._deferred import creation_site
from ._resources import Addressed

__all__ = ["RemoteSegment", "RemoteAgent"]


class _Registered:
    """Memory registered with our agent and mapped by the daemon as one remote segment: what
    every `RemoteSegment` of that memory shares (a registration of the same memory again is
    reused, counted by `refs`; the last free lets it go).

    Deferred (`ep` set): the daemon has not been sent it until `defined`; its `define(new)`
    is the RegisterRemote that goes ahead of the first request naming `va`."""

    __slots__ = ("va", "reg", "refs", "array", "key", "ep", "site", "defined", "freed")

    def __init__(self, va: int, reg: Any, array: np.ndarray, ep: Any = None, site: str = "") -> None:
        self.va, self.reg, self.refs, self.array = va, reg, 1, array
        #: What `RemoteAgent.live` knows it by: (address, bytes).
        self.key = (int(reg.addr), int(reg.nbytes))
        self.ep, self.site = ep, site
        self.defined = ep is None  # (eager: the daemon answered before we got here)
        self.freed = False

    @property
    def deferred(self) -> bool:
        """Named with a VA of the session's arena (the daemon maps it on first use)."""
        return self.ep is not None

    def define(self, new: Callable[..., P.Request]) -> P.Request:
        """The RegisterRemote naming `va` (DeferredState calls it, once): the metadata of this
        one registration, with our connection info (the first may not have reached the
        daemon), taken after registering (it carries the buffer's remote key)."""
        metadata = self.ep.registration_metadata([self.reg], include_conn=True)
        return new(P.RegisterRemote, metadata, self.reg.descs_bytes, int(self.array.nbytes), self.va, self.site)


class RemoteAgent:
    """This process's NIXL agent for one client session (created on first use), and what it
    has registered, by (address, bytes): the registration holds the memory, so the address
    cannot be reused for other memory while it is live."""

    def __init__(self, session_id: int) -> None:
        from ..transport._nixl import NixlEndpoint

        # Agent names are chosen by us and checked for clashes by the daemon.
        self.name = f"tx-s{session_id}-p{os.getpid()}-{secrets.token_hex(4)}"
        self.ep = NixlEndpoint(self.name, progress="event")
        self.live: dict[tuple[int, int], _Registered] = {}
        #: Memory freed whose free the daemon has not answered yet, by (address, bytes) (the
        #: answer deregisters it).
        self.leaving: dict[tuple[int, int], _Registered] = {}

    def let_go(self, shared: _Registered) -> None:
        """Deregister `shared`'s memory (the daemon has let go of it, or never had it)."""
        if self.live.get(shared.key) is shared:
            del self.live[shared.key]
        if not self.ep.closed:
            self.ep.deregister(shared.reg)

    def close(self) -> None:
        self.live.clear()
        self.leaving.clear()
        self.ep.close()


class RemoteSegment(Addressed):
    """A buffer in this process that the daemon reads and writes by VA (over NIXL)."""

    def __init__(self, client: Any, array: np.ndarray, shared: _Registered) -> None:
        self._client = client
        self.va = shared.va
        self.nbytes = int(array.nbytes)
        self._array: np.ndarray | None = array
        self._shared: _Registered | None = shared

    @property
    def _reg(self) -> Any:
        """The NIXL registration (None once freed)."""
        return self._shared.reg if self._shared is not None else None

    @property
    def buffer(self) -> np.ndarray:
        """The registered memory as a flat uint8 array (what the daemon reads or writes)."""
        if self._array is None:
            raise E.SegmentFreed(f"remote segment {self.va:#x} has been freed")
        return self._array.reshape(-1).view(np.uint8)

    @property
    def array(self) -> np.ndarray:
        """The array as registered (its own shape and dtype)."""
        if self._array is None:
            raise E.SegmentFreed(f"remote segment {self.va:#x} has been freed")
        return self._array

    @property
    def freed(self) -> bool:
        return self._array is None

    def free(self) -> Any:
        """The same as `client.free(self)` (awaitable on a trio client)."""
        return self._client.free(self)

    def _release(self) -> bool:
        """This handle goes: True if it was the last of its memory's (the daemon's segment and
        the registration go then, in that order: `Session._op_free_remote`)."""
        shared, self._array = self._shared, None
        if shared is None:
            return False
        shared.refs -= 1
        if shared.refs:
            self._shared = None
        return not shared.refs

    def _detach(self) -> None:
        """This handle no longer names the memory (its registration is the caller's to end)."""
        self._shared = None

    def __repr__(self) -> str:
        return f"<RemoteSegment va={self.va:#x} nbytes={self.nbytes}{' freed' if self.freed else ''}>"


def register(client: Any, agent: RemoteAgent, array: np.ndarray, call: Callable[..., Generator[Any, None, Any]],
             deferred: Any = None, lock: Any = None) -> Generator[Any, None, RemoteSegment]:
    """Register `array` with our agent, then with the daemon: an operation (see client._session)
    whose `call(cls, *args)` is the client's own request-and-wait operation. `deferred`: the
    session's `DeferredState`, when it has arenas, and `lock` the client's lock that guards it."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"register_remote takes a NumPy array, got {type(array).__name__}")
    if not array.flags.c_contiguous or not array.flags.writeable or array.nbytes == 0:
        raise E.InvalidField("register_remote needs a writable, C-contiguous, non-empty array")
    key = (int(array.ctypes.data), int(array.nbytes))
    if key in agent.leaving:  # freed, the daemon's answer still to come: it deregisters, then we register anew
        yield from call(P.Ping)  # (the free travels ahead of it)
    shared = agent.live.get(key)
    if shared is not None:  # the same memory again: its registration and segment, reused
        shared.refs += 1
        return RemoteSegment(client, array, shared)
    reg = agent.ep.register_address(key[0], key[1], owner=array)  # (checked above: NIXL's own register, less its checks)
    try:
        if deferred is not None:
            shared = _Registered(0, reg, array, agent.ep, creation_site())
            with lock:
                shared.va = deferred.name(shared, shared.site)
        else:
            # (Metadata is taken after registering: it carries the buffer's remote key.)
            metadata = agent.ep.registration_metadata([reg], include_conn=True)
            info = yield from call(P.RegisterRemote, metadata, reg.descs_bytes, int(array.nbytes))
            shared = _Registered(info.va, reg, array)
    except BaseException:
        agent.ep.deregister(reg)
        raise
    agent.live[key] = shared
    return RemoteSegment(client, array, shared)
