"""Planning copies that name remote segments: what the planner calls when a VA falls in one.

A copy between a producer's remote segment and the daemon's memory becomes one op of one
peer and one direction (`RemoteWork`: NIXL's descriptor rows for both ends); a vector of
them is laid out once (`remote_plan`) and kept (`RemotePlan`) so the same vector again, a
producer's fixed slots, is only checked against the table. Compute that reads a remote
input pulls it into staging first (`pull_input`). The posting is `_remote.RemotePlane`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from .. import errors as E
from ..addressing import Segment, SegmentKind
from ._ops import Op, Range, Staged
from ._remote import RemotePlane

__all__ = ["RemotePlan", "RemoteWork", "names_remote", "plan_remote_copy", "pull_input", "remote_op", "remote_plan"]

_NO_ROWS = np.zeros((0, 3), np.uint64)


@dataclass(eq=False, slots=True)
class RemoteWork:
    """What one planned op asks of the data plane: ranges of one peer, one direction."""

    plane: "RemotePlane"
    peer: str
    op: str  # "READ" (remote -> local) or "WRITE" (local -> remote)
    #: NIXL's descriptor rows, as the post takes them: (N, 3) uint64 (address, nbytes, 0);
    #: they total the op's `nbytes`.
    local: np.ndarray  # in the daemon's memory
    remote: np.ndarray  # in the peer's memory
    #: What the op answers, computed once its transfer is done (a verified copy's sums of
    #: what landed); None: it answers nothing (a plain copy).
    then: Callable[[], Any] | None = None
    #: The plan it runs, whose NIXL request a post of this op alone reuses (`RemotePlan.prepared`).
    plan: "RemotePlan | None" = None
    #: The memory type of the `local` rows: "DRAM", or "VRAM" (a GPU's, registered as such).
    mem: str = "DRAM"


@dataclass(eq=False, slots=True)
class RemotePlan:
    """A vector of copies between one peer's remote segments and the daemon's memory, as
    `remote_plan` derives it from the mapping table. The plane keeps it (`RemotePlane.plans`),
    so that the same vector again, a producer's fixed slots, is checked against the table
    (`holds`) instead of translated and laid out again: ~15 us of the daemon's thread per
    1 MiB request."""

    plane: "RemotePlane"
    peer: str
    op: str  # "READ" or "WRITE"
    #: NIXL's descriptor rows (`RemoteWork`'s), totalling `nbytes`; empty when nothing moves.
    local: np.ndarray
    remote: np.ndarray
    nbytes: int
    reads: list[Range]
    writes: list[Range]
    #: Every segment the copies name; the daemon's own among them; the device they run on.
    segs: list[Segment[Any]]
    local_segs: list[Segment[Any]]
    device: Any
    #: Per piece, the daemon's end of it (segment, offset, nbytes): what a verified copy sums.
    ends: list[tuple[Segment[Any], int, int]]
    #: Its NIXL request, made at its first post alone and posted again after (`N.Prepared`).
    prepared: Any = None
    #: The memory type of the local rows (`RemoteWork.mem`).
    mem: str = "DRAM"

    def holds(self, table: Any, owner: Any) -> bool:
        """Whether the table still says what this plan was made from: each segment is the one
        still in the table under its id, `owner` may use it, and each remote one is still
        declared by its peer. (A segment's size never changes, so its ranges stay in bounds.)"""
        for seg in self.segs:
            if table.get(seg.id) is not seg:
                return False
            if seg.kind == SegmentKind.REMOTE:
                if seg.owner != owner or not self.plane.declares(seg.handle):
                    return False
            elif seg.owner != owner and owner not in seg.guests:
                return False
        return True


# --- planning copies that name remote segments (called by server._planner) ---------------------
def names_remote(table: Any, vas: Iterable[int]) -> bool:
    """Whether any of these VAs falls in a remote segment (unchecked: only to route)."""
    for va in vas:
        seg = table.get(va >> 40)
        if seg is not None and seg.kind == SegmentKind.REMOTE:
            return True
    return False

def _plane(planner: Any) -> "RemotePlane":
    plane: RemotePlane | None = planner.remote
    if plane is None:
        raise E.InvalidField("remote segments are served by the RDMA data plane (not enabled in this daemon)")
    return plane


def _check_owner(seg: Segment[Any], owner: Any) -> None:
    if seg.owner != owner:
        raise E.NotOwner(f"remote segment {seg.id} belongs to another session (remote segments are not shareable)")


def plan_remote_copy(planner: Any, owner: Any, req: Any) -> Op:
    """One copy to or from a remote segment: `remote_plan` of one row."""
    n = req.nbytes
    dseg, doff = planner.table.translate(req.dst, n, owner)
    sseg, soff = planner.table.translate(req.src, n, owner)
    plan = remote_plan(planner, owner, [(dseg.id, doff, sseg.id, soff, n)], {dseg.id: dseg, sseg.id: sseg},
                       [(sseg.id, soff, soff + n)], [(dseg.id, doff, doff + n)])
    return remote_op(req.id, plan)


def remote_plan(
    planner: Any, owner: Any, rows: list[tuple[int, int, int, int, int]], segs: dict[int, Segment[Any]],
    reads: list[Range], writes: list[Range],
) -> RemotePlan:
    """Plan copies between a remote (NIXL) segment and the daemon's memory.

    `rows` are (dst segment, dst offset, src segment, src offset, nbytes), bounds and
    ownership checked by the table; `reads` and `writes` their hazard ranges. All READs
    (remote -> local) or all WRITEs (local -> remote), with one peer; destinations must
    not overlap (one RDMA post has no order inside). A remote segment is exactly one range
    its producer declared, so a range the table bounds by the segment lies inside a
    declared range: what is left to check is that the segment is still declared
    (`check_declared`).

    Plain Python over the rows: vectors are short, and NumPy's fixed cost per call
    (tens of calls) was most of a 4-copy group's daemon time.
    """
    plane = _plane(planner)
    remote: dict[int, Segment[Any]] = {}
    for sid, seg in segs.items():
        if seg.kind == SegmentKind.REMOTE:
            _check_owner(seg, owner)
            remote[sid] = seg
    # Per piece, empty ones too, the daemon's end: the memory a verified copy sums.
    ends = [(segs[ss], so, n) if ds in remote else (segs[ds], do, n) for ds, do, ss, so, n in rows]
    rows = [r for r in rows if r[4]]
    both = local_only = False
    writes_n = total = 0  # rows writing to a remote segment; bytes
    for ds, _, ss, _, n in rows:
        d, s = ds in remote, ss in remote
        if d:
            both = both or s
            writes_n += 1
        elif not s:
            local_only = True
        total += n
    if both:
        raise E.InvalidField("a copy between two remote segments is not supported: copy through a daemon buffer")
    if local_only:
        raise E.InvalidField("a vector mixing remote and local-only copies: send them as separate requests")
    if 0 < writes_n < len(rows):
        raise E.InvalidField("a vector mixing reads from and writes to remote segments: send them as separate requests")
    write = writes_n > 0
    op = "WRITE" if write else "READ"
    local_segs = [segs[s] for s in {r[2] if write else r[0]: None for r in rows}]
    dev = planner._device_of(local_segs, total)
    plan = RemotePlan(plane, "", op, _NO_ROWS, _NO_ROWS, 0, reads, writes, list(segs.values()), local_segs, dev, ends)
    if not rows:
        return plan
    peers = {seg.handle.peer for seg in remote.values()}
    if len(peers) != 1:
        raise E.InvalidField("copies name remote segments of several NIXL agents")
    (plan.peer,) = peers
    for seg in remote.values():
        plane.check_declared(seg.handle)
    mems = {seg.id: plane.local_memory(seg, _backend_of(planner, seg)) for seg in local_segs}
    kinds = {m[1] for m in mems.values()}
    if len(kinds) > 1:
        raise E.InvalidField("a remote batch reading into (or writing from) both GPU and host memory: send them as separate requests")
    (plan.mem,) = kinds
    lbase = {sid: m[0] for sid, m in mems.items()}
    ldev = {sid: m[2] for sid, m in mems.items()}
    # (local address, remote address, nbytes) per row
    if write:
        pairs = [(lbase[ss] + so, remote[ds].handle.addr + do, n) for ds, do, ss, so, n in rows]
        devs = [ldev[ss] for _, _, ss, _, _ in rows]
    else:
        pairs = [(lbase[ds] + do, remote[ss].handle.addr + so, n) for ds, do, ss, so, n in rows]
        devs = [ldev[ds] for ds, _, _, _, _ in rows]
    if len(pairs) > 1:
        # Destinations must not overlap: inside one post, NIXL gives no order.
        k = 1 if write else 0
        order = sorted(range(len(pairs)), key=lambda i: pairs[i][k])
        for a, b in zip(order, order[1:]):
            if pairs[b][k] < pairs[a][k] + pairs[a][2]:
                raise E.InvalidField(f"copy {b}: its destination overlaps another copy's in the same remote batch")
    # Merge runs that continue each other on both sides (fewer descriptors).
    merged = [[*pairs[0], devs[0]]]
    for (la, ra, n), dv in zip(pairs[1:], devs[1:]):
        last = merged[-1]
        if la == last[0] + last[2] and ra == last[1] + last[2] and dv == last[3]:
            last[2] += n
        else:
            merged.append([la, ra, n, dv])
    # NIXL's descriptor rows, made here once: each post hands them over as they are.
    plan.local = np.array([(la, n, dv) for la, _, n, dv in merged], np.uint64)
    plan.remote = np.array([(ra, n, 0) for _, ra, n, _ in merged], np.uint64)
    plan.nbytes = total
    return plan


def remote_op(rid: int, plan: RemotePlan) -> Op:
    """The op that runs a plan: one NIXL post (none when nothing moves)."""
    if not plan.nbytes:
        return Op(rid, [], [], plan.device, 0, lambda: None)
    # No `run`: a wave posts its remote ops itself, grouped (`_waves._post_remote`).
    return Op(rid, list(plan.reads), list(plan.writes), plan.device, plan.nbytes,
              remote=RemoteWork(plan.plane, plan.peer, plan.op, plan.local, plan.remote, plan=plan, mem=plan.mem))


def _backend_of(planner: Any, seg: Segment[Any]) -> Any:
    """The backend whose memory a local device segment is (None: host memory)."""
    return planner.devices[seg.device].backend if seg.kind == SegmentKind.DEVICE else None


def pull_input(planner: Any, owner: Any, rseg: Segment[Any], roff: int, nbytes: int) -> tuple[Op, Any, int]:
    """An internal op (no reply of its own) reading a remote range into a staging buffer."""
    plane = _plane(planner)
    _check_owner(rseg, owner)
    if nbytes <= 0:  # (a NIXL descriptor cannot be empty; the post is not checked again)
        raise E.InvalidField("an empty compute input in a remote segment: there is nothing to read")
    handle = rseg.handle
    raddr = handle.addr + roff
    plane.check_declared(handle)
    arr, staging = plane.staging(nbytes, planner.host_backend)
    reg = staging[0]
    staged = Staged(arr)
    work = RemoteWork(plane, handle.peer, "READ", np.array([[reg.addr, nbytes, 0]], np.uint64), np.array([[raddr, nbytes, 0]], np.uint64))
    pull = Op(0, [(rseg.id, roff, roff + nbytes)], [(staged.id, 0, nbytes)], planner.devices[0], nbytes, remote=work)
    pull.info = staging
    return pull, staged, 0
