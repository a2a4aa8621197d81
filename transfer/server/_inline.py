"""Graph runs a ring's native worker serves itself, on its own thread.

A RUN_GRAPH descriptor names a graph and one input and one output VA. The first run with
those VAs goes the general way (the worker hands the ring to the event loop; the planner
translates, places and keeps the placement, `_graphrun`). If every node landed on one
device whose backend can bind the stretch to its memory (`Backend.inline_steps`: the CPU
devices), the bound stretch is kept here too, by (session, graph, input, output). From then
on the worker calls `InlineRuns.runner(session)` for such a descriptor, with the GIL, and
the run is one call: no handover, no event loop, no plan, no process hop; the worker pushes
the completion in ring order.

What makes that safe:
- **Order.** The worker serves a session's ring in order; a descriptor that follows a
  socket frame (FLAG_AFTER) is handed over, and a frame waits for the descriptors sent
  before it: the session has no other work in flight while the worker runs one.
- **Memory.** The bound views hold their mappings (a host segment's memfd, a CPU device
  buffer's), so a free during a run never unmaps what the run touches; and every change
  of the table (a free, a detach, a session's end) drops everything kept here
  (`MappingTable.on_change`), so the next run is planned again, and refused if an operand
  has gone, with the error a request gets.
- **Errors.** A node that fails answers the descriptor with its error's code and the
  message on the control socket, from the loop (`report`), as the Python pass answers one.
"""

from __future__ import annotations

from typing import Any, Callable

import trio

from .. import errors as E

__all__ = ["InlineRuns"]

#: Bound runs kept (as many as the planner keeps placements).
KEPT = 1024

#: A bound stretch: called with the session's worker, it runs (a CPU device) or queues (a GPU:
#: `backends._replay`) the run; what is known at once: the seconds its kernels took (the
#: session's device time; 0 for queued work, which the worker's events time) and the run's
#: error (None: none, or none yet).
Bound = Callable[[Any], tuple[float, "E.TransferError | None"]]


class InlineRuns:
    """The bound graph runs, by (session id, graph VA, input VA, output VA), each with the
    segments its device work must hold (none for a CPU device's)."""

    def __init__(self) -> None:
        self.kept: dict[tuple[int, int, int, int], tuple[Bound, tuple[int, ...]]] = {}
        #: Answers a failed run's error on the control socket (the loop's; set by the server).
        self.report: Callable[[Any, int, E.TransferError], None] = lambda session, rid, err: None

    def keep(self, owner: int, graph: int, src: int, dst: int, bound: Bound, holds: tuple[int, ...] = ()) -> None:
        if len(self.kept) >= KEPT:
            self.clear()
        self.kept[(owner, graph, src, dst)] = (bound, holds)

    def clear(self) -> None:
        kept, self.kept = self.kept, {}
        for bound, _ in kept.values():
            close = getattr(bound, "close", None)
            if close is not None:
                close()  # (a replay: its graph goes once no launch of it is in flight)

    def runner(self, session: Any) -> Callable[[int, int, int, int, int], int | None] | None:
        """What the session's worker calls for a RUN_GRAPH (on its thread, with the GIL): the
        status it answers, or None (not kept: the worker hands the ring over). None outside a
        trio run (nothing could carry an error's message)."""
        runs, sid, stats = self, session.id, session.stats
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            return None
        report = self.report

        def run(rid: int, graph: int, src: int, dst: int, stream: int) -> int | None:
            entry = runs.kept.get((sid, graph, src, dst))
            if entry is None or not session.running:
                return None
            bound, holds = entry
            worker = session.worker
            for seg in holds:
                if not worker.hold(seg):
                    return None  # (a segment the native table does not have: the Python pass serves it)
            seconds, err = bound(worker)
            if seconds:  # (a CPU device's run: its kernels' time is the session's device time)
                stats.device_ns += int(seconds * 1e9)
            if err is None:
                return 0
            try:
                token.run_sync_soon(report, session, rid, err)
            except trio.RunFinishedError:
                pass  # the daemon is stopping: the client fails what it waits for
            return err.code

        return run

