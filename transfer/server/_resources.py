"""Resources a session can make the daemon hold: segments, quotas, arenas, sharing.

Every VA-named thing lives in the one mapping table; this module creates and
drops its entries and keeps the per-session and daemon-wide byte counts that
quotas check. Nothing here runs requests.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from typing import Any, Callable, Sequence

import trio

from .. import _results as R
from .. import errors as E
from .. import protocol as P
from .._units import fmt_bytes
from ..addressing import MAX_SEGMENT_BYTES, OFFSET_BITS, MappingTable, Segment, SegmentKind
from ..backends import Backend
from ..memory import ShmFile
from ..memory._shm import PREFIX
from ._config import DaemonConfig
from ._dataplane import DataPlane
from ._fds import FdChannel
from ._placement import VirtualDevice, choose_home
from ._remote import RemotePlane
from ._session import Session

__all__ = ["Resources"]

log = logging.getLogger("transfer.server")


class Resources:
    """The mapping table's owner: register, allocate, share, attach, free, release."""

    def __init__(
        self, config: DaemonConfig, table: MappingTable[Any], devices: Sequence[VirtualDevice],
        backends: Sequence[Backend], remote: RemotePlane, instance: Callable[[], str], fds: FdChannel,
        dataplane: DataPlane,
    ) -> None:
        self.config = config
        self.table = table
        self.devices = list(devices)
        self.backends = list(backends)
        self.remote = remote
        self._instance = instance
        #: Where the client collects each segment's memfd.
        self.fds = fds
        #: The native workers' mirror of the table: every add and drop goes there too.
        self.dataplane = dataplane
        #: Share tokens -> segment id (see Share/Attach).
        self.shares: dict[bytes, int] = {}
        self.device_bytes = 0
        #: Shared-memory bytes of every session (the whole daemon's `max_host_bytes` budget).
        self.host_bytes = 0
        #: Host segments mapped now, and how many may be (each mapping holds a descriptor:
        #: the daemon sizes this from its fd limit, `_config.fd_budget`).
        self.host_segments = 0
        self.max_host_segments = 1 << 16
        #: Device index -> sessions homed there (a tie-break of `choose_home`).
        self.homed: Counter[int] = Counter()
        self._remote_start = trio.Lock()

    # --- quotas ------------------------------------------------------------------------------
    def check_quota(self, session: Session, nbytes: int, kind: SegmentKind) -> None:
        cfg = self.config
        if not 0 < nbytes <= MAX_SEGMENT_BYTES:
            raise E.InvalidField(f"segment size {nbytes} is outside 1..{MAX_SEGMENT_BYTES}")
        if cfg.max_segments_per_session and len(session.segments) >= cfg.max_segments_per_session:
            raise E.QuotaExceeded(f"session already has {len(session.segments)} segments (limit {cfg.max_segments_per_session})")
        if kind == SegmentKind.REMOTE:
            return
        if kind == SegmentKind.HOST:
            limit, used = cfg.max_host_bytes_per_session, session.host_bytes
            what = "host"
            if cfg.max_host_bytes and self.host_bytes + nbytes > cfg.max_host_bytes:
                raise E.OutOfSharedMemory(
                    f"cannot reserve {fmt_bytes(nbytes)} of shared memory: the daemon's budget (--max-host-bytes) "
                    f"has {fmt_bytes(cfg.max_host_bytes - self.host_bytes)} of {fmt_bytes(cfg.max_host_bytes)} free"
                )
        else:
            limit, used = cfg.max_device_bytes_per_session, session.device_bytes
            what = "device"
            if self.device_bytes + nbytes > cfg.max_device_bytes:
                raise E.OutOfDeviceMemory(
                    f"alloc of {fmt_bytes(nbytes)}: the daemon's device budget (--max-device-bytes) has "
                    f"{fmt_bytes(cfg.max_device_bytes - self.device_bytes)} of {fmt_bytes(cfg.max_device_bytes)} left"
                )
        if limit and used + nbytes > limit:
            raise E.QuotaExceeded(
                f"the session's {what} memory quota (--max-{what}-bytes-per-session): {fmt_bytes(used)} in use "
                f"+ {fmt_bytes(nbytes)} asked > {fmt_bytes(limit)}"
            )

    # --- admission: the home device and the arenas ------------------------------------------------
    def admit(self, session: Session) -> tuple[int, list[R.Arena]]:
        """What hello grants: the session's home device (chosen once, here) and its arenas."""
        home = choose_home(self.devices, self.homed)
        session.home_device = home.index
        self.homed[home.index] += 1
        if session.priority == P.PRIORITY_LATENCY:
            for backend in self.backends:
                backend.prioritize(session.id)  # (its lanes' streams: the device's greatest priority)
        try:
            arenas = self.grant_arenas(session)
        except BaseException:
            self.unadmit(session)
            raise
        return home.index, arenas

    def unadmit(self, session: Session) -> None:
        """Undo `admit` (idempotent)."""
        self.release_arenas(session)
        if session.home_device >= 0:
            self.homed[session.home_device] -= 1
            if not self.homed[session.home_device]:
                del self.homed[session.home_device]
            session.home_device = -1

    def grant_arenas(self, session: Session) -> list[R.Arena]:
        """One block of segment ids per device, and the session's byte quota on it."""
        cfg = self.config
        quota = cfg.max_device_bytes_per_session or cfg.max_device_bytes
        out = []
        for dev in self.devices:
            first = self.table.reserve_block(cfg.arena_ids, session.id)
            session.arenas[dev.index] = (first, cfg.arena_ids)
            out.append(R.Arena(dev.index, first, cfg.arena_ids, quota))
        return out

    def release_arenas(self, session: Session) -> None:
        for first, count in session.arenas.values():
            self.table.release_block(first, count)
        session.arenas.clear()

    # --- creating ------------------------------------------------------------------------------
    def register_host(self, session: Session, nbytes: int) -> R.Registered:
        self.check_quota(session, nbytes, SegmentKind.HOST)
        if self.host_segments >= self.max_host_segments:
            raise E.QuotaExceeded(f"the daemon maps {self.host_segments} shared-memory segments, its limit (each holds a file "
                                  "descriptor; raise the fd limit to raise it): free some, or use larger ones")
        self.fds.check_room(session)
        sid = self.table.reserve_id()
        shm = ShmFile.create(f"{PREFIX}{self._instance()}.seg{sid}", nbytes)
        try:
            for backend in self.backends:
                backend.register_host(shm)
            seg = self.table.add_reserved(sid, SegmentKind.HOST, nbytes, session.id, shm)
            try:
                self.dataplane.mirror(seg)
            except BaseException:
                self.table.remove(sid)
                raise
        except BaseException:
            shm.close()
            raise
        session.segments.add(seg.id)
        session.host_bytes += nbytes
        self.host_bytes += nbytes
        self.host_segments += 1
        # The client collects the memfd with this token (single use) from the fd socket.
        token = seg.info["fd_token"] = self.fds.offer(session, shm.take_fd())
        return R.Registered(seg.va, nbytes, token)

    def alloc_at(self, session: Session, segment_id: int | None, nbytes: int, device: int) -> R.Allocated:
        """Allocate a device buffer; under a given (arena) segment id for deferred allocations.
        Device -1 is the session's home device (`admit`), for eager and deferred alike."""
        self.check_quota(session, nbytes, SegmentKind.DEVICE)
        ndev = len(self.devices)
        if device == -1:
            if session.home_device < 0:
                raise E.SessionError(f"session {session.id} has no home device (no hello?): name a device")
            device = session.home_device
        if not 0 <= device < ndev:
            raise E.InvalidField(f"device {device} does not exist (this daemon has {ndev})")
        vdev = self.devices[device]
        try:
            mem = vdev.backend.alloc(nbytes, vdev.local_id)
        except MemoryError:
            raise E.OutOfDeviceMemory(f"device {device} cannot allocate {nbytes} bytes") from None
        try:
            if segment_id is None:
                seg = self.table.add(SegmentKind.DEVICE, nbytes, session.id, mem, device)
            else:
                seg = self.table.add_reserved(segment_id, SegmentKind.DEVICE, nbytes, session.id, mem, device)
        except BaseException:
            vdev.backend.free(mem)
            raise
        try:
            self.dataplane.mirror(seg, vdev.backend)
        except BaseException:
            self.table.remove(seg.id)
            vdev.backend.free(mem)
            raise
        session.segments.add(seg.id)
        session.device_bytes += nbytes
        self.device_bytes += nbytes
        vdev.info["bytes"] = vdev.info.get("bytes", 0) + nbytes
        return R.Allocated(seg.va, nbytes, device)

    def register_remote_now(self, session: Session, req: P.RegisterRemote) -> R.RemoteRegistered | None:
        """RegisterRemote on the event loop, a few microseconds, while the NIXL agent runs and
        no post holds it; None when it needs a thread (`register_remote`)."""
        sid = self._remote_admissible(session, req)
        handle = self.remote.add_segment(session.id, req.metadata, req.descs, req.nbytes, blocking=False)
        return None if handle is None else self._map_remote(session, req, sid, handle)

    async def register_remote(self, session: Session, req: P.RegisterRemote) -> R.RemoteRegistered:
        """Map a producer's NIXL-registered buffer as a remote segment (agent start and
        metadata loading run on a worker thread: the first one takes ~0.6 s)."""
        sid = self._remote_admissible(session, req)
        async with self._remote_start:
            handle = await trio.to_thread.run_sync(self.remote.add_segment, session.id, req.metadata, req.descs, req.nbytes)
        assert handle is not None
        if not session.running:
            self.remote.drop_segment(handle)
            raise E.SessionClosed("the session is closing")
        return self._map_remote(session, req, sid, handle)

    def _remote_admissible(self, session: Session, req: P.RegisterRemote) -> int | None:
        """RegisterRemote's checks before NIXL is touched; the arena id it names (`va`), if any."""
        self.check_quota(session, req.nbytes, SegmentKind.REMOTE)
        if not self.remote.available():
            raise E.InvalidField(
                "remote segments need NIXL in the daemon (pip install --no-deps nixl-cu12==1.5.1)"
                if self.remote.enabled else "remote segments are disabled in this daemon"
            )
        if not req.va:
            return None
        sid, _device = self.arena_slot(session, req.va, "remote segment")
        return sid

    def _map_remote(self, session: Session, req: P.RegisterRemote, sid: int | None, handle: Any) -> R.RemoteRegistered:
        try:
            if sid is None:
                seg = self.table.add(SegmentKind.REMOTE, req.nbytes, session.id, handle)
            else:
                seg = self.table.add_reserved(sid, SegmentKind.REMOTE, req.nbytes, session.id, handle)
        except BaseException:
            self.remote.drop_segment(handle)
            raise
        session.segments.add(seg.id)
        log.debug("session %d: remote segment %d of %d bytes from agent %r", session.id, seg.id, req.nbytes, handle.peer)
        return R.RemoteRegistered(seg.va, req.nbytes, self.remote.name)

    def arena_slot(self, session: Session, va: int, what: str) -> tuple[int, int]:
        """The (segment id, device) of one of `session`'s arena ids, free to define at `va`."""
        sid = va >> OFFSET_BITS
        arena = next((dev for dev, (first, n) in session.arenas.items() if first <= sid < first + n), None)
        if va & ((1 << OFFSET_BITS) - 1) or arena is None:
            raise E.InvalidAddress(f"{what}: VA {va:#x} is not a segment of this session's arenas")
        if self.table.get(sid) is not None:
            raise E.InvalidAddress(f"{what}: segment {sid} is already defined (defined twice?)")
        return sid, arena

    # --- sharing -------------------------------------------------------------------------------
    def share(self, session: Session, va: int) -> R.Shared:
        seg = self.table.lookup(va, session.id)
        if seg.owner != session.id:
            raise E.NotOwner(f"only the owner may share segment {seg.id}")
        if va != seg.va:
            raise E.InvalidAddress(f"share needs a segment's base VA ({seg.va:#x}), got {va:#x}")
        token = secrets.token_bytes(16)
        self.shares[token] = seg.id
        seg.info.setdefault("tokens", []).append(token)
        return R.Shared(token)

    def attach(self, session: Session, token: bytes) -> R.Attached:
        sid = self.shares.get(token)
        seg = self.table.get(sid) if sid is not None else None
        if seg is None:
            raise E.UnknownSegment("no shared segment has that token (never shared, or freed since)")
        if seg.owner != session.id:
            seg.guests.add(session.id)
            session.attached.add(seg.id)
            self.dataplane.guest(seg, session, True)
        return R.Attached(seg.va, seg.nbytes, seg.kind.name.lower(), seg.device)  # type: ignore[arg-type]

    # --- releasing -----------------------------------------------------------------------------
    def free(self, session: Session, va: int, kind: SegmentKind) -> None:
        """Unregister (host or remote) or Free (device): the owner frees, a guest only detaches."""
        seg = self.table.lookup(va, session.id)
        if va != seg.va:
            raise E.InvalidAddress(f"free needs a segment's base VA ({seg.va:#x}), got {va:#x}")
        if kind == SegmentKind.HOST and seg.kind == SegmentKind.REMOTE:
            kind = SegmentKind.REMOTE  # Unregister releases remote segments too
        if seg.kind != kind:
            raise E.InvalidField(f"segment {seg.id} is a {seg.kind.name.lower()} segment")
        if seg.owner != session.id:
            # A guest's Unregister/Free detaches it; the memory stays with its owner.
            seg.guests.discard(session.id)
            self.table.touch()  # (its plans that named the segment are stale)
            session.attached.discard(seg.id)
            self.dataplane.guest(seg, session, False)
            return
        self.drop(session, seg)

    def drop(self, session: Session, seg: Segment[Any]) -> None:
        """Remove a segment of `session`'s and release its memory."""
        self.table.remove(seg.id)
        self.dataplane.forget(seg)  # no worker is inside it from here on
        for token in seg.info.get("tokens", ()):
            self.shares.pop(token, None)
        session.segments.discard(seg.id)
        if seg.kind == SegmentKind.REMOTE:
            self.remote.drop_segment(seg.handle)
            return
        self.remote.forget_local(seg)  # deregister from our NIXL agent before the memory goes
        if seg.kind == SegmentKind.HOST:
            session.host_bytes -= seg.nbytes
            self.host_bytes -= seg.nbytes
            self.host_segments -= 1
            self.fds.revoke(seg.info.get("fd_token"))  # not collected yet: nobody will now
            shm: ShmFile = seg.handle
            try:
                for backend in self.backends:
                    backend.unregister_host(shm)
            finally:
                shm.close()
        elif seg.kind == SegmentKind.DEVICE:
            session.device_bytes -= seg.nbytes
            self.device_bytes -= seg.nbytes
            vdev = self.devices[seg.device]
            vdev.info["bytes"] -= seg.nbytes
            vdev.backend.free(seg.handle)

    def release(self, session: Session) -> None:
        """Everything the session holds goes: lanes, home, arenas, attachments, segments, remote peers."""
        for backend in self.backends:
            backend.forget_lanes(session.id)  # its device streams (each wave left them synchronized)
        self.unadmit(session)
        for sid in session.attached:
            seg = self.table.get(sid)
            if seg is not None:
                seg.guests.discard(session.id)
                self.dataplane.guest(seg, session, False)
        if session.attached:
            self.table.touch()
        session.attached.clear()
        for sid in list(session.segments):
            seg = self.table.get(sid)
            if seg is not None:
                self.drop(session, seg)
        session.segments.clear()
        self.fds.forget(session)  # uncollected memfds of its segments and ring
        self.remote.drop_session(session.id)
