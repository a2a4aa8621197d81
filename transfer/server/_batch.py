"""The batch form a pass takes from a session's queue, and its planning.

A `Batch` is one pass's share of a session's queue: the data requests, the control
requests answered after them, what was refused, the planned ops and their waves, and
whether the pass runs inline or may be pipelined (`one_lane`). `plan_batch` plans its data
requests, runs of plain copies as one vector op.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .. import errors as E
from .. import protocol as P
from ..ring import VECTOR_RUN, CopyRun, answers
from ._ops import RING, SOCKET, Op, lane_of
from ._planner import Refusal
from ._session import Session
from ._waves import one_device

__all__ = ["Batch", "one_lane", "joins", "plan_batch"]


def one_lane(ops: list[Op]) -> tuple[Any, Any] | None:
    """(device, lane) if the pass may be pipelined, else None: every op runs on one lane of
    one GPU (a stream backend, which orders host work after the queued device work it
    touches), or on one CPU device (lane None: the session's completer runs its passes in
    order on that device's worker). Never with RDMA."""
    device = one_device(ops) if ops else None
    if device is None:
        return None
    lane = ops[0].lane if device.kind == "gpu" else None
    if lane is not None and any(op.lane != lane for op in ops):
        return None
    return device, lane


def joins(batch: "Batch", tail: "Batch | None") -> bool:
    """Whether a pass goes on the session's CPU pipeline as it is: one CPU device, the
    pipeline's own (or an empty pipeline and work too big to run inline)."""
    pipe = batch.pipe
    if pipe is None or pipe[0].kind == "gpu" or batch.remote is not None:
        return False
    return pipe == tail.pipe if tail is not None else not batch.inline


class Batch:
    """One pass's share of a session's queue, and what became of it."""

    __slots__ = ("session", "remote", "data", "after", "replies", "refused", "ops", "waves", "inline", "socket_n", "ring_n", "pipe", "fence", "control", "ran")

    def __init__(self, session: Session) -> None:
        self.session = session
        #: A RegisterRemote taken alone (it waits on a worker thread).
        self.remote: P.RegisterRemote | None = None
        self.data: list[tuple[Any, int]] = []
        self.after: list[tuple[Any, int]] = []
        #: Answers already known: (request id, route, reply), in order.
        self.replies: list[tuple[int, int, P.Reply]] = []
        self.refused: list[tuple[int, int, E.TransferError]] = []
        self.ops: list[Op] = []
        self.waves: list[list[Op]] = []
        self.inline = True
        self.socket_n = 0
        self.ring_n = 0
        #: (device, lane) when every op runs on that one GPU lane, or on one CPU device (lane
        #: None): the pass may be pipelined (queued, answered once done, while the next pass
        #: is planned and queued behind it).
        self.pipe: tuple[Any, Any] | None = None
        #: A pipelined GPU pass: the fence its completion waits for (None on a CPU).
        self.fence: Any = None
        #: The types of the control requests taken (their latency is accounted per kind).
        self.control: list[type] = []
        #: A pipelined CPU pass: its work has run (set by the worker that ran it).
        self.ran = False

    def count(self, req: Any, route: int) -> None:
        """One queue entry taken: it holds a credit (socket) or completion slots (ring) until answered."""
        n = answers(req, route == RING)
        if route == RING:
            self.ring_n += n
        else:
            self.socket_n += n


def plan_batch(planner: Any, owner: Any, items: Sequence[tuple[Any, int]]) -> tuple[list[Op], list[Refusal]]:
    """Plan a pass's data requests, (request, route) pairs in arrival order.

    Returns the ops in arrival order and the refused requests. Runs of plain
    copies (socket Copy requests in a row, or a ring's CopyRun) are planned as
    one vector op validated at once; if any copy in a run is invalid, the
    run is planned one by one so that only that copy fails.
    """
    ops: list[Op] = []
    refused: list[Refusal] = []

    def one(req: P.Request, route: int) -> None:
        try:
            planned = planner.plan(owner, req)
        except E.TransferError as exc:
            refused.append((req.id, route, exc))
            return
        except Exception as exc:  # a bug: fail this request, keep serving
            refused.append((req.id, route, E.InternalError(f"{type(exc).__name__}: {exc}")))
            return
        lane = lane_of(owner, req.stream)  # type: ignore[attr-defined]  # every data request has one
        for op in planned if isinstance(planned, list) else (planned,):
            if op.rid:
                op.route = route
            op.lane = lane
            ops.append(op)

    def vector(ids: Any, dst: np.ndarray, src: np.ndarray, size: np.ndarray, route: int, stream: int) -> bool:
        try:
            op = planner.plan_copies(owner, int(ids[0]), dst, src, size)
        except E.TransferError:
            return False  # one of them is bad: the caller plans them one by one
        op.kind, op.ids, op.route, op.lane = "copy", ids, route, lane_of(owner, stream)
        ops.append(op)
        return True

    run: list[P.Copy] = []
    run_route = SOCKET

    def flush() -> None:
        n = len(run)
        if n >= VECTOR_RUN and vector(
            [r.id for r in run],
            np.fromiter((r.dst for r in run), np.uint64, n),
            np.fromiter((r.src for r in run), np.uint64, n),
            np.fromiter((r.nbytes for r in run), np.uint64, n),
            run_route,
            run[0].stream,
        ):
            run.clear()
            return
        for r in run:
            one(r, run_route)
        run.clear()

    for req, route in items:
        if type(req) is P.Copy:
            if run and (route != run_route or req.stream != run[0].stream):
                flush()
            run.append(req)
            run_route = route
            continue
        if run:
            flush()
        if type(req) is CopyRun:
            if not vector(req.ids, req.dst, req.src, req.nbytes, route, req.stream):
                for r in req.singles():
                    one(r, route)
        else:
            one(req, route)
    if run:
        flush()
    return ops, refused
