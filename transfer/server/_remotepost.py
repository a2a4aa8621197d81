"""A wave's remote copies, posted: each group of one peer and one direction as ONE NIXL transfer.

Nothing in a wave conflicts, so each (plane, peer, direction) group of its remote ops is
one transfer whose descriptor list is the concatenation of the ops' ranges
(`remote_groups`, `group_ranges`). Small groups go out from the loop in posts of bounded
size (`loop_posts`, `post_remote_on_loop`), larger ones on a worker thread (`post_remote`);
an op whose answer needs the bytes (a verified copy's sums) gets it where the post ran
(`landed`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import trio

from ._ops import Op, fail_ops

__all__ = ["remote_groups", "group_ranges", "post_remote_on_loop", "post_remote", "landed", "loop_posts", "remote_limiter"]


def remote_groups(wave: Sequence[Op]) -> tuple[list[Op], list[list[Op]]]:
    """Split a wave: (local ops, remote ops grouped by (plane, peer, direction, local memory type)).

    Nothing in a wave conflicts, so each group can be ONE NIXL transfer whose
    descriptor list is the concatenation of its ops' ranges.
    """
    local: list[Op] = []
    groups: dict[tuple[int, str, str, str], list[Op]] = {}
    for op in wave:
        w = op.remote
        if w is None:
            local.append(op)
        else:
            groups.setdefault((id(w.plane), w.peer, w.op, w.mem), []).append(op)
    return local, list(groups.values())


def group_ranges(ops: Sequence[Op]) -> tuple[np.ndarray, np.ndarray, int, Any]:
    """One post's rows (local, remote), bytes, and the plan whose NIXL request it posts
    again (an op posted alone: its `RemoteWork.plan`), for a group of remote ops."""
    if len(ops) == 1:
        w = ops[0].remote
        return w.local, w.remote, ops[0].nbytes, w.plan
    return (np.concatenate([o.remote.local for o in ops]), np.concatenate([o.remote.remote for o in ops]),
            sum(o.nbytes for o in ops), None)


async def post_remote_on_loop(ops: Sequence[Op]) -> None:
    """Small groups: post from the loop (a same-host post of <= inline_bytes takes tens of
    microseconds, less than a thread hop), then poll with short sleeps until done."""
    w = ops[0].remote
    local, remote, nbytes, plan = group_ranges(ops)
    try:
        xfer = w.plane.start(w.peer, w.op, local, remote, nbytes, plan, w.mem)
        if not w.plane.finish(xfer, wait=False):  # (a same-host cma post copies in place: done)
            delay = 20e-6
            # Shielded: a cancelled session must not free memory a transfer still writes into
            # (the wait is bounded by the plane's timeout; a dead peer fails it within ms).
            with trio.CancelScope(shield=True):
                while not w.plane.finish(xfer, wait=False):
                    await trio.sleep(delay)
                    delay = min(delay * 2, 1e-3)
    except Exception as exc:  # a NIXL failure fails these requests, not the daemon
        fail_ops(ops, exc)
        return
    landed(ops)


def post_remote(ops: Sequence[Op]) -> None:
    """Post one group as one transfer and wait (blocking: a worker thread's job)."""
    w = ops[0].remote
    local, remote, nbytes, plan = group_ranges(ops)
    try:
        w.plane.post(w.peer, w.op, local, remote, nbytes, plan, w.mem)
    except Exception as exc:  # a NIXL failure fails these requests, not the daemon
        fail_ops(ops, exc)
        return
    landed(ops)


def landed(ops: Sequence[Op]) -> None:
    """A group's transfer is done: each op's answer that needs its bytes (`RemoteWork.then`:
    a verified copy's sums), where the post ran, while they are still in cache."""
    for op in ops:
        then = op.remote.then
        if then is not None:
            try:
                op.result = then()
            except Exception as exc:
                fail_ops([op], exc)


def loop_posts(group: list[Op], limit: int) -> list[list[Op]]:
    """Cut a remote group into posts of at most `limit` bytes each, at op boundaries; a
    group with an op larger than `limit` stays ONE post, for a worker thread.

    Posting from the loop blocks it only while a same-host (cma) post copies in place:
    <= 1 MiB is ~80 us, far less than two thread hops on 2 cores (a pass that took two
    1 MiB frames went to a thread, and the hop was a quarter of the daemon's CPU per
    frame). NIC and tcp posts return at once whatever the size (then we poll). So a
    group is several posts from the loop, with the loop yielding between them
    (`_waves._on_device`), rather than one post on a thread; it stays one post when it fits.
    Not beside a thread's post of the same group: a post holds the plane's lock while
    it copies, so a loop post would wait out the thread's large copy.
    """
    if sum(o.nbytes for o in group) <= limit or any(o.nbytes > limit for o in group):
        return [group]
    parts: list[list[Op]] = []
    cur: list[Op] = []
    size = 0
    for op in group:
        if cur and size + op.nbytes > limit:
            parts.append(cur)
            cur, size = [], 0
        cur.append(op)
        size += op.nbytes
    if cur:
        parts.append(cur)
    return parts


_REMOTE_LIMITER: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("transfer_remote_limiter")


def remote_limiter() -> trio.CapacityLimiter:
    """Threads posting NIXL transfers (one limiter per trio run; posts block, briefly)."""
    try:
        return _REMOTE_LIMITER.get()
    except LookupError:
        lim = trio.CapacityLimiter(2)
        _REMOTE_LIMITER.set(lim)
        return lim
