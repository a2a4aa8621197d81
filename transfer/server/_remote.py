"""The daemon's side of the RDMA data plane: one NIXL agent, remote segments, batched posts.

`RemotePlane` owns the daemon's NIXL agent (created lazily, on a worker
thread, by the first RegisterRemote: it takes ~0.6 s and most daemons never
need it). It knows:

* which producer agent belongs to which session (agent names are chosen by
  the peer: a name already used by another session is refused);
* what each producer *declared* (its descriptor list): a remote segment is
  exactly one declared range, the mapping table bounds every range by its
  segment, and a post goes out only while its segment is still declared
  (`check_declared`), whatever NIXL itself would accept;
* which of the daemon's own memory (device buffers, shared-memory segments)
  is registered with the agent as DRAM (lazily, once per segment; released
  with the segment).

`post()` runs ONE NIXL transfer for a whole descriptor list and waits for it;
it blocks (a same-host `cma` READ copies inside the post), so the scheduler
calls it on a worker thread. The planning of copies that name remote
segments is `_remoteplan`'s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import errors as E
from ..addressing import SegmentKind
from ..transport import _nixl as N

__all__ = ["RemotePlane", "RemoteHandle"]


log = logging.getLogger("transfer.remote")


@dataclass(eq=False)
class RemoteHandle:
    """The mapping table's handle for a `remote` segment: (agent, remote address, length)."""

    peer: str
    addr: int
    nbytes: int
    session: int


@dataclass
class _Peer:
    name: str
    session: int
    #: (address, nbytes) -> how many of the session's remote segments declare that range.
    declared: Counter[tuple[int, int]] = field(default_factory=Counter)
    dead: bool = False


class RemotePlane:
    """The daemon's NIXL agent and everything it has been told."""

    def __init__(self, name: str, timeout_s: float = 30.0, enabled: bool = True) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.ep: N.NixlEndpoint | None = None
        self._lock = threading.Lock()  # NIXL calls from the loop and from post threads
        self._peers: dict[str, _Peer] = {}
        self._by_session: dict[int, str] = {}
        #: Plans of copy vectors, by (owner, the request's vectors as bytes) (`RemotePlan`;
        #: the planner's `_recall`). Emptied whenever a segment goes, so no plan keeps one.
        self.plans: dict[tuple[Any, bytes, bytes, bytes], Any] = {}  # (_remoteplan.RemotePlan)
        self.counters = {"nixl_posts": 0, "nixl_reposts": 0, "nixl_descs": 0, "nixl_bytes": 0, "nixl_failures": 0, "nixl_peers": 0}

    # --- lifecycle -----------------------------------------------------------------------
    def available(self) -> bool:
        return self.enabled and N.available()

    def ensure_started(self) -> N.NixlEndpoint:
        """Create the agent (blocking, ~0.6 s: call it on a worker thread)."""
        with self._lock:
            if self.ep is None:
                if not self.enabled:
                    raise E.InvalidField("remote segments are disabled in this daemon (--rdma false)")
                # No progress thread: the daemon only initiates (READ/WRITE), and its posts and
                # waits progress the worker themselves. An "event" thread woke with each transfer's
                # traffic and spun on the worker lock for as long as the post held it (a same-host
                # cma copy): 28 % of the daemon's CPU at 1 MiB over tcp, on a 2-core machine.
                self.ep = N.NixlEndpoint(self.name, progress="none")
                log.info("NIXL agent %r started", self.name)
            return self.ep

    def close(self) -> None:
        self.plans.clear()
        with self._lock:
            if self.ep is not None:
                self.ep.close()
                self.ep = None
            self._peers.clear()
            self._by_session.clear()

    # --- peers and segments ------------------------------------------------------------------
    def add_segment(self, session: int, metadata: bytes, descs: bytes, nbytes: int, *, blocking: bool = True) -> RemoteHandle | None:
        """Load a producer's metadata (first time: its agent becomes this session's peer) and
        declare one remote buffer.

        Blocking (the agent's first start takes ~0.6 s, and a post holds the agent while a
        same-host READ copies): call it on a worker thread. With `blocking=False` it is a
        few microseconds, for the event loop: None when the agent has not started or is held
        (then call it blocking, on a thread). Bad input raises either way."""
        declared = N.decode_descs(descs)  # strict; never pickle
        if declared.mem_type != "DRAM":
            raise E.InvalidField(f"remote segments must be host memory (DRAM), got {declared.mem_type}")
        if len(declared) != 1:
            raise E.InvalidField(f"a remote segment is one registered range, got {len(declared)} descriptors")
        addr, length = (int(x) for x in declared.ranges[0])
        if length != nbytes:
            raise E.InvalidField(f"descriptor length {length} != nbytes {nbytes}")
        name = N.peek_agent_name(metadata)
        ep = self.ensure_started() if blocking else self.ep
        if ep is None or not self._lock.acquire(blocking=blocking):
            return None
        try:
            return self._declare(ep, session, name, metadata, addr, length)
        finally:
            self._lock.release()

    def _declare(self, ep: N.NixlEndpoint, session: int, name: str, metadata: bytes, addr: int, length: int) -> RemoteHandle:
        """`add_segment`'s part under the agent's lock."""
        self.plans.clear()  # (the peer's metadata is loaded again: no request made from the old is kept)
        known = self._by_session.get(session)
        if known is not None and name != known:
            raise E.InvalidField(f"this session's NIXL agent is {known!r}; metadata names {name!r}")
        other = self._peers.get(name)
        if known is None and (other is not None or name == self.name):
            raise E.InvalidField(f"NIXL agent name {name!r} is already in use: choose a unique name")
        try:
            # Re-loading our own session's agent merges the new registrations.
            loaded = ep.add_peer(metadata, expected_name=name) if known else ep.add_peer(metadata)
        except E.NixlError as exc:
            raise E.InvalidField(f"unusable NIXL metadata: {exc}") from None
        peer = self._peers.get(loaded)
        if peer is None:
            peer = self._peers[loaded] = _Peer(loaded, session)
            self._by_session[session] = loaded
            self.counters["nixl_peers"] += 1
        peer.declared[(addr, length)] += 1
        return RemoteHandle(loaded, addr, length, session)

    def drop_segment(self, handle: RemoteHandle) -> None:
        """Forget one declared range (before the producer may deregister it)."""
        self.plans.clear()
        with self._lock:
            peer = self._peers.get(handle.peer)
            if peer is None:
                return
            key = (handle.addr, handle.nbytes)
            if peer.declared[key] > 1:
                peer.declared[key] -= 1
            else:
                peer.declared.pop(key, None)

    def drop_session(self, session: int) -> None:
        """The session ended: forget its peer and disconnect from it."""
        self.plans.clear()
        with self._lock:
            name = self._by_session.pop(session, None)
            if name is None:
                return
            self._peers.pop(name, None)
            self.counters["nixl_peers"] -= 1
            if self.ep is not None:
                try:
                    self.ep.remove_peer(name)
                except E.NixlError as exc:
                    log.warning("removing NIXL peer %r: %s", name, exc)

    def check_declared(self, handle: RemoteHandle) -> None:
        """The segment's range is still one this session's peer declares.

        A remote segment is exactly one declared range, and the mapping table bounds
        every range by its segment, so each range the daemon reads or writes on a peer
        lies inside what that peer declared for as long as this holds.
        """
        if self.declares(handle):
            return
        peer = self._peers.get(handle.peer)
        if peer is None or peer.session != handle.session:
            raise E.SegmentFreed(f"NIXL peer {handle.peer!r} is gone")
        raise E.SegmentFreed(f"remote range (0x{handle.addr:x}, {handle.nbytes} bytes) is no longer registered")

    def declares(self, handle: RemoteHandle) -> bool:
        """`check_declared` as a question."""
        peer = self._peers.get(handle.peer)
        return peer is not None and peer.session == handle.session and (handle.addr, handle.nbytes) in peer.declared

    # --- the daemon's own memory ---------------------------------------------------------------
    def local_memory(self, seg: Any, backend: Any) -> tuple[int, str, int]:
        """A local segment's memory, registered with our agent (once): (address, NIXL memory
        type, device id). A GPU's memory is registered as VRAM, so a remote READ lands in
        it (and a WRITE leaves it) with no host bounce; a backend whose device memory is
        host memory (NumPy, the stream simulation) registers it as DRAM."""
        reg: N.Registration | None = seg.info.get("nixl_reg")
        if reg is not None:
            return reg.addr, reg.mem_type, reg.dev_id
        if self.ep is None:
            raise E.InvalidField("no remote segment registered yet")
        where: tuple[int, int, str, int] | None
        if seg.kind == SegmentKind.HOST:
            arr = seg.handle.array
            where = (int(arr.ctypes.data), int(arr.nbytes), "DRAM", 0)
        else:
            where = backend.nixl_memory(seg.handle) if backend is not None else None
            if where is None:
                raise E.InvalidField(f"remote copies to or from this backend's device memory ({getattr(backend, 'name', '?')}) "
                                     "are not supported: copy through a host segment")
        addr, nbytes, mem, dev = where
        with self._lock:
            reg = self.ep.register_address(addr, nbytes, owner=seg.handle, mem=mem, dev_id=dev)  # type: ignore[arg-type]
        seg.info["nixl_reg"] = reg
        return reg.addr, reg.mem_type, reg.dev_id

    def staging(self, nbytes: int, backend: Any) -> tuple[np.ndarray, Any]:
        """A private buffer registered with our agent: where a compute's remote inputs land.
        Its memory is the CPU backend's (`backend`), which its device processes can map.
        Returns (array, what `release_staging` takes)."""
        if self.ep is None:
            raise E.InvalidField("no remote segment registered yet")
        arr = backend.alloc(max(nbytes, 1), 0)
        try:
            with self._lock:
                reg = self.ep.register(arr)
        except BaseException:
            backend.free(arr)
            raise
        return arr, (reg, arr, backend)

    def release_staging(self, staging: Any) -> None:
        reg, arr, backend = staging
        try:
            if self.ep is not None:
                with self._lock:
                    try:
                        self.ep.deregister(reg)
                    except E.NixlError as exc:
                        log.warning("deregistering a staging buffer: %s", exc)
        finally:
            backend.free(arr)

    def forget_local(self, seg: Any) -> None:
        """A segment of the daemon's own goes (every one, registered or not: plans name it)."""
        self.plans.clear()
        reg = seg.info.pop("nixl_reg", None)
        if reg is not None and self.ep is not None:
            with self._lock:
                try:
                    self.ep.deregister(reg)
                except E.NixlError as exc:
                    log.warning("deregistering segment %d: %s", seg.id, exc)

    # --- transfers -------------------------------------------------------------------------------
    def post(self, peer: str, op: str, local: np.ndarray, remote: np.ndarray, nbytes: int, plan: Any = None, mem: str = "DRAM") -> None:
        """ONE NIXL transfer for the whole list; blocks until done (call on a worker thread)."""
        xfer = self.start(peer, op, local, remote, nbytes, plan, mem)
        self.finish(xfer, wait=True)

    def start(self, peer: str, op: str, local: np.ndarray, remote: np.ndarray, nbytes: int, plan: Any = None, mem: str = "DRAM") -> Any:
        """Post ONE transfer for the whole descriptor list (`RemoteWork`'s rows, `nbytes` in
        all); return it (maybe done already: a same-host `cma` transfer copies inside the post).
        `plan`: the rows are that plan's alone, and its NIXL request is posted again
        (`RemotePlan.prepared`), unless a posting of it is still out. `mem`: the memory type
        of the local rows (VRAM: a GPU's)."""
        ep = self.ep
        if ep is None:
            raise E.BackendError("the NIXL agent is not running")
        p = self._peers.get(peer)
        if p is None:
            raise E.PeerDisconnected(f"NIXL peer {peer!r} is gone (its session ended)")
        if p.dead:
            raise E.PeerDisconnected(f"NIXL peer {peer!r} disconnected earlier")
        self.counters["nixl_posts"] += 1
        self.counters["nixl_descs"] += int(local.shape[0])
        try:
            with self._lock:
                # Rows the planner built from translated ranges (remote_plan, pull_input): checked.
                if plan is not None:
                    if plan.prepared is None:
                        plan.prepared = ep.prepare(op, peer, local, remote, mem)
                    if not plan.prepared.busy:
                        self.counters["nixl_reposts"] += plan.prepared.handle is not None
                        return ep.post_prepared(plan.prepared, nbytes)
                if op == "READ":
                    return ep.read(peer, local, remote, checked=True, nbytes=nbytes, local_mem=mem)
                return ep.write(peer, local, remote, checked=True, nbytes=nbytes, local_mem=mem)
        except E.NixlError as exc:
            self._failed(p, exc)
            raise

    def finish(self, xfer: Any, *, wait: bool) -> bool:
        """Complete a started transfer: True when done (then released); False if `wait` is
        False and it is still in flight. Raises (and releases) on failure or timeout."""
        try:
            if wait:
                xfer.wait(self.timeout_s)
            elif not xfer.poll():
                if time.perf_counter() - xfer.posted_at < self.timeout_s:
                    return False
                raise E.TransferTimeout(f"{xfer.op} of {xfer.nbytes} bytes with {xfer.peer!r} not done after {self.timeout_s} s")
        except E.NixlError as exc:
            self._failed(self._peers.get(xfer.peer), exc)
            self._release(xfer)
            raise
        self.counters["nixl_bytes"] += xfer.nbytes
        self._release(xfer)
        return True

    def _failed(self, peer: _Peer | None, exc: Exception) -> None:
        self.counters["nixl_failures"] += 1
        if peer is not None and isinstance(exc, E.PeerDisconnected):
            peer.dead = True

    @staticmethod
    def _release(xfer: Any) -> None:
        try:
            xfer.release()
        except E.NixlError as exc:  # still in flight (timeout): the endpoint's close() retries
            log.warning("releasing %r: %s", xfer, exc)
