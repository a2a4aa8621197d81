"""The one pass every request goes through, whatever brought it.

Socket frames, ring descriptors and remote sessions all queue the same
batch form on their session: (request, route) pairs in arrival order, where
the route says only where the answer goes (a reply frame, or a completion on
the ring). A pass then:

1. **takes** what is queued up to the next barrier (control requests before
   it run first, in order: `_control`);
2. **plans** it (`_planner`: every VA translated and checked, runs of copies
   as one vector op);
3. **schedules** the ops into hazard-free waves (`_waves`);
4. **executes** them: on the event loop when the pass is small (at most
   `inline_bytes`, no RDMA), else on the devices' worker threads, or (a CPU
   device's kernels) sent to its process, the loop told when they are done.
   Inline is a decision here, not a second implementation;
5. makes the device work **visible** (each device synchronized as its share
   of a wave ends), and only then
6. **completes**: one reply frame for socket requests, completions on the
   ring for ring requests, error details as replies;
7. **accounts** once (`_accounting`).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import trio

from .. import errors as E
from .. import protocol as P
from ..ring import COMPLETION_DTYPE
from ._accounting import Accounting
from ._config import DaemonConfig
from ._control import AFTER_PASS, BARRIERS, Control
from ._deferred import resolve
from ._ops import RING, Op, in_process, runs_inline
from ..ring import COMPLETION_DETAIL, CopyRun, answers
from ._planner import Planner, plan_batch
from ._rings import Rings
from ._session import Session
from ._waves import Sent, assign_waves, device_failed, issue, issue_off_loop, one_device, run_inline, run_stretch, run_waves, send_pass, wait_visible

__all__ = ["Pass", "Batch"]

_BARRIERS = frozenset(BARRIERS)
_AFTER = frozenset(AFTER_PASS)
#: Requests whose device work only queues (no kernel to compile, no result to wait for).
_QUEUES_AT_ONCE = frozenset(("copy", "copyv", "fill"))
#: How long a pipelined pass's fence is polled from the loop before a worker waits for it.
_POLL_S = 500e-6
#: Passes in a row that `kick` runs inline before it hands the rest to the session's task.
_INLINE_PASSES = 4
#: How long a worker runs a session's queued CPU passes before it lets other sessions have it.
_CPU_SLICE_S = 0.02
#: A session's passes queued in a CPU device's process: one running, one waiting behind it.
_AHEAD = 2


def _one_lane(ops: list[Op]) -> tuple[Any, Any] | None:
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


def _joins(batch: "Batch", tail: "Batch | None") -> bool:
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


class Pass:
    def __init__(
        self, config: DaemonConfig, planner: Planner, limiters: dict[int, trio.CapacityLimiter],
        control: Control, rings: Rings, accounting: Accounting, send: Callable[[bytes, bytes], None],
    ) -> None:
        self.config = config
        self.planner = planner
        self.limiters = limiters
        self.control = control
        self.rings = rings
        self.accounting = accounting
        self.send = send
        #: Set by the server: end a session (its NIXL peer died mid-transfer).
        self.on_peer_lost: Callable[[Session], None] = lambda s: None
        #: The daemon is draining (set by the front): what cannot run fails ShuttingDown.
        self.shutting_down = False
        #: Threads waiting for pipelined passes' fences (apart from the devices' workers).
        self.waiters = trio.CapacityLimiter(64)

    # --- entry points --------------------------------------------------------------------------
    def kick(self, session: Session) -> None:
        """Requests were queued: run small passes right now, queue a pass that only joins the
        session's CPU pipeline right now, and hand anything else to the session's task."""
        if session.ring_wait is not None:
            # A frame waits for the ring requests its client pushed before it (`Rings.catch_up`).
            session.wake.set()
            return
        for _ in range(_INLINE_PASSES):
            if session.current is not None or not session.queue:
                break
            tail = session.pipeline[-1] if session.pipeline else None
            if tail is not None and (tail.fence is not None or type(session.queue[0][0]) in _BARRIERS):
                break  # a GPU pipeline, or a barrier that waits for the pipeline: the task's
            if self.planner.remote_bound(session.queue[0][0]):
                # Never inline (it waits on a NIXL post): the task takes it, with what the pump
                # delivers before the task runs (the rest of this burst). Taken here, it was a
                # pass of its own: 1.6 requests a pass against 2.0, each pass one post and one
                # reply (~4 us of the daemon's thread per 1 MiB request).
                break
            batch = self.take(session)
            if _joins(batch, tail):
                # Only queued (what `run` would do, without the hop to the session's task):
                # the completer's worker runs it in turn, after the passes before it.
                self._queue_cpu(session, batch)
                continue
            if tail is not None or not batch.inline:
                session.current = batch  # answers stay in order: the task runs it in its turn
                break
            run_inline(batch.waves)
            self.complete(batch)
        if session.current is not None or session.queue or not session.accepting:
            session.wake.set()  # else the task has nothing to do: only passes were queued

    async def run(self, session: Session) -> None:
        """The session task's step: the pass `kick` handed over, or a new one."""
        if session.current is None and session.ring_wait is not None:
            await self.rings.catch_up(session)
            return
        if session.current is None and session.pipeline and session.queue and type(session.queue[0][0]) in _BARRIERS:
            await self.drain(session)  # a barrier runs once everything before it is done
        batch = session.current or self.take(session)
        session.current = batch
        pipelined = False
        try:
            if batch.pipe is not None and (session.pipeline or not batch.inline):
                pipelined = await self._issue(session, batch)
            else:
                await self.drain(session)
                if batch.remote is not None:
                    batch.replies.append((batch.remote.id, 0, await self.control.execute_async(session, batch.remote)))
                elif batch.inline:
                    run_inline(batch.waves)
                else:
                    await run_waves(batch.waves, self.limiters, self.config.inline_bytes, lambda: self._stopped(session))
        finally:
            session.current = None
        if not pipelined:
            self.complete(batch)
        await trio.lowlevel.checkpoint()  # a queue of inline passes must not hold the loop

    # --- pipelining: passes queued behind one another ------------------------------------------------
    async def _issue(self, session: Session, batch: Batch) -> bool:
        """Queue a one-lane pass without waiting for it; the session's completer answers it.

        The GPU then runs this pass while the loop takes and queues the next: the engine does
        not idle for a round trip per pass. A CPU pass is queued as planned, and sent to the
        device's process at once where it runs there (`_send_cpu`), else run in turn by the
        device's worker (`_run_queued`): the CPU does not idle while the loop plans and
        answers. Returns False if it ran to completion instead."""
        assert batch.pipe is not None
        if session.pipeline and session.pipeline[-1].pipe != batch.pipe:
            await self.drain(session)  # another lane or device: nothing would order the two
        device, lane = batch.pipe
        if device.kind != "gpu":
            self._queue_cpu(session, batch)
            return True
        try:
            if all(op.kind in _QUEUES_AT_ONCE and (batch.inline or not op.host_only) for op in batch.ops) and device.backend.all_pinned():
                batch.fence = issue(batch.waves, device, lane)  # cudaMemcpyAsync from pinned pages: returns at once
            else:  # kernels (may compile), checksums (wait for a result), pinning: off the loop
                batch.fence = await trio.to_thread.run_sync(issue_off_loop, batch.waves, device, lane, limiter=self.limiters[device.index])
        except Exception as exc:  # recording the fence failed: the device is in trouble
            device_failed(batch.ops, f"queueing on {device}", exc)
            return False
        device.completed += 1
        session.pipeline.append(batch)
        session.pipeline_wake.set()
        self.accounting.counters["pipelined_passes"] += 1
        return True

    def _queue_cpu(self, session: Session, batch: Batch) -> None:
        """A CPU pass joins the session's pipeline, and is sent to the device's process at
        once if it can be (`_send_cpu`); else the completer runs it in turn."""
        device = batch.pipe[0]  # type: ignore[index]
        device.queued_bytes += sum(op.cost for op in batch.ops)
        session.pipeline.append(batch)
        session.pipeline_wake.set()
        self.accounting.counters["pipelined_passes"] += 1
        self._send_cpu(session, device)

    async def drain(self, session: Session) -> None:
        """Wait until every pipelined pass of the session has been answered."""
        while session.pipeline:
            await session.pipeline_moved.wait()

    async def answer_pipeline(self, session: Session) -> None:
        """The session's completer: answers pipelined passes in order, each once its fence passes."""
        while True:
            if not session.pipeline:
                await session.pipeline_wake.wait()
                session.pipeline_wake = trio.Event()
                continue
            batch = session.pipeline[0]
            if batch.fence is None:  # CPU passes: run them, in order; each is answered as it ends
                with trio.CancelScope(shield=True):  # what was sent or started finishes
                    await self._run_cpu(session, batch.pipe[0])
                continue
            with trio.CancelScope(shield=True):  # issued work finishes: its memory is in use until then
                # Look between the loop's other work for a while (a query is a microsecond, a
                # thread hop tens), then let a worker wait for long work.
                give_up = time.perf_counter() + _POLL_S
                while not wait_visible(batch.fence, batch.ops, block=False):
                    if time.perf_counter() > give_up:
                        await trio.to_thread.run_sync(wait_visible, batch.fence, batch.ops, limiter=self.waiters)
                        break
                    await trio.lowlevel.checkpoint()
            session.pipeline.popleft()
            self.complete(batch)
            moved, session.pipeline_moved = session.pipeline_moved, trio.Event()
            moved.set()

    def _send_cpu(self, session: Session, device: Any) -> None:
        """(On the loop.) Send the session's next pipelined passes to the CPU device's process,
        while fewer than `_AHEAD` are there and each runs wholly there, without waiting: the
        process goes from one to the next while the loop plans and answers, and the loop is
        told when each is done (as it reads the process's answers; `_sent_done`). A pass
        the process cannot take now is left part-sent: the completer has a thread send the
        rest (`_run_cpu`), and nothing is sent behind it meanwhile."""
        sent, pipeline = session.sent, session.pipeline
        while len(sent) < _AHEAD and len(pipeline) > len(sent):
            if sent and not sent[-1][1].sent_all:
                return
            batch = pipeline[len(sent)]
            if not _on_cpu(batch, device):
                return  # another device's: once these are answered
            new = send_pass(batch.waves, lambda: self._stopped(session))
            if new is None:
                return  # the daemon runs it: a worker, once these are answered
            sent.append((batch, new))
            if not new.send(False):
                return
            self._when_done(session, new, device)

    def _when_done(self, session: Session, sent: Sent, device: Any) -> None:
        """(On the loop.) `_sent_done` once the pass's answers are in: called right there when
        the loop itself reads the last one (the process's answers are read on the loop), else
        (a thread read it, or it is in already, while `_send_cpu` is still going) soon."""
        token, loop = trio.lowlevel.current_trio_token(), threading.get_ident()
        registered = False

        def done() -> None:
            if registered and threading.get_ident() == loop:
                self._sent_done(session, sent, device)
            else:
                _soon(token, self._sent_done, session, sent, device)

        sent.on_done(done)
        registered = True

    def _sent_done(self, session: Session, sent: Sent, device: Any) -> None:
        """(On the loop, as the process's answers are read.) A sent pass is done: answer
        every done pass at the head, in order, right here (no hop to the completer's task),
        and send the next ones."""
        sent.done = True
        queue = session.sent
        while queue and queue[0][1].done:
            batch, done = queue.popleft()
            done.end()
            batch.ran = True
            self._answer_ran(session, batch)
        self._send_cpu(session, device)
        session.pipeline_wake.set()  # the completer: a pass a worker runs, or a send to finish

    async def _run_cpu(self, session: Session, device: Any) -> None:
        """The completer's share of a session's CPU passes, in order. Passes sent to the
        device's process (`_send_cpu`) are answered when the loop is told they are done
        (`_sent_done`): no thread waits for them, so a small compute costs no thread hop.
        Here: a pass the process could not take at once is sent by a thread, and a pass
        the daemon runs itself (a copy) runs on the device's worker (`_run_queued`) once
        those before it are answered."""
        sent, pipeline = session.sent, session.pipeline
        while True:
            self._send_cpu(session, device)
            if sent and not sent[-1][1].sent_all:  # the process could not take it without waiting
                rest = sent[-1][1]
                await trio.to_thread.run_sync(rest.send, True, limiter=self.waiters)
                self._when_done(session, rest, device)
                continue
            if sent:  # until they are answered, or a new pass comes to send
                session.pipeline_wake = trio.Event()
                await session.pipeline_wake.wait()
                continue
            batch = pipeline[0] if pipeline else None
            if batch is None or not _on_cpu(batch, device):
                return
            await trio.to_thread.run_sync(self._run_queued, session, device, trio.lowlevel.current_trio_token(),
                                          limiter=self.limiters[device.index])

    def _run_queued(self, session: Session, device: Any, token: trio.lowlevel.TrioToken) -> None:
        """A worker thread: the session's queued CPU passes that the daemon runs itself, in
        order, until one that runs in the device's process comes (the loop sends those), none
        is left, or its slice of the device's worker is used up. Each is answered on the loop
        as it ends, while this thread goes on to the next one the loop planned meanwhile."""
        give_up = time.perf_counter() + _CPU_SLICE_S
        stop = lambda: self._stopped(session)  # noqa: E731
        while time.perf_counter() <= give_up:
            # A snapshot (the loop appends and answers meanwhile; tuple() copies under the GIL).
            batch = next((b for b in tuple(session.pipeline) if not b.ran), None)
            if batch is None or not _on_cpu(batch, device):
                return
            if in_process(batch.ops):
                return  # the loop sends it to the device's process
            try:
                run_stretch(batch.waves, device, stop)
            except Exception as exc:  # a bug below the ops' own handling: fail this pass, serve on
                device_failed(batch.ops, f"running on {device}", exc)
            batch.ran = True
            token.run_sync_soon(self._answer_ran, session, batch)

    def _answer_ran(self, session: Session, batch: Batch) -> None:
        """On the loop: a pipelined CPU pass has run; answer it. It is the pipeline's head: one
        worker at a time runs a session's passes, in order, and these calls come in order."""
        session.pipeline.popleft()
        device = batch.pipe[0]  # type: ignore[index]
        device.queued_bytes -= sum(op.cost for op in batch.ops)
        device.completed += 1
        self.complete(batch)
        moved, session.pipeline_moved = session.pipeline_moved, trio.Event()
        moved.set()

    def _stopped(self, session: Session) -> E.TransferError | None:
        """Between waves: the error for what has not started, once the session stopped running."""
        if session.running:
            return None
        if self.shutting_down:
            return E.ShuttingDown("the daemon is shutting down: its grace ran out before this request ran")
        return E.SessionClosed("the session closed before this request ran")

    def fail_queued(self, session: Session, err: E.TransferError) -> None:
        """Answer everything queued with `err` (socket replies; completions for ring requests)."""
        b = Batch(session)
        q = session.queue
        while q:
            req, route = q.popleft()
            b.count(req, route)
            if type(req) is CopyRun:
                b.refused.extend((int(i), route, err) for i in req.ids.tolist())
            else:
                b.refused.append((req.id, route, err))
        if b.refused:
            self.complete(b)

    # --- take and plan -------------------------------------------------------------------------
    def take(self, session: Session) -> Batch:
        """Steps 1-3: take up to a barrier (running the barriers at the head), plan, schedule."""
        q = session.queue
        b = Batch(session)
        taken = 0
        limit = self.config.max_pass
        running = session.running
        while q and taken < limit and running:
            req, route = q[0]
            t = type(req)
            if t in _BARRIERS:
                if b.data or b.after:
                    break  # a barrier: it runs once what came before it has completed
                if t is P.RegisterRemote:
                    if not taken:
                        q.popleft()
                        b.count(req, route)
                        b.remote = req
                        b.inline = False
                        b.control.append(t)
                    break
                q.popleft()
                taken += 1
                b.count(req, route)
                b.control.append(t)
                b.replies.append((req.id, route, self.control.execute(session, req)))
                running = session.running  # a Close stops the take here
                continue
            q.popleft()
            taken += 1
            b.count(req, route)
            if t is P.BadRequest:
                b.refused.append((req.id, route, req.error))
            elif t in _AFTER:
                b.after.append((req, route))
                b.control.append(t)
            elif t is P.ComputeRef:
                try:
                    b.data.append((resolve(session, req), route))
                except E.TransferError as exc:
                    b.refused.append((req.id, route, exc))
            else:
                b.data.append((req, route))
        if not running and q:
            # Closed in this pass (a Close, or reclaimed): what was queued behind it is answered now.
            err = E.SessionClosed("the session closed before this request ran")
            while q:
                req, route = q.popleft()
                b.count(req, route)
                if route != RING:  # ring requests: the ring closes with the session, failing them client-side
                    b.refused.append((req.id, route, err))
        if b.data:
            b.ops, refused = plan_batch(self.planner, session.id, b.data)
            if refused:
                b.refused.extend(refused)
            b.waves = assign_waves(b.ops)
            for op in b.ops:
                if op.remote is not None or (op.kind == "compute" and op.device.kind == "gpu"):
                    b.inline = False  # remote posts wait; GPU kernels may compile (never on the loop)
            if not runs_inline(b.ops, self.config.inline_bytes):
                b.inline = False
            b.pipe = _one_lane(b.ops)
        return b

    # --- complete and account ------------------------------------------------------------------
    def complete(self, b: Batch) -> None:
        """Steps 6-7: answer every request of the pass, then account for it once."""
        session = b.session
        replies: list[P.Reply] = [r for _, route, r in b.replies]
        comps: list[tuple[int, int, int, int, int]] = []
        arrays: list[np.ndarray] = []
        codes: list[int] = [r.error.code for r in replies if r.error is not None]
        for rid, route, refusal in b.refused:
            codes.append(refusal.code)
            replies.append(P.Reply(rid, error=refusal))
            if route == RING:
                comps.append((rid, refusal.code, 0, COMPLETION_DETAIL, 0))
        peer_lost = False
        for op in b.ops:
            if op.rid == 0:
                continue  # internal (a staging pull): its compute answers
            err = op.error
            if err is not None:
                peer_lost = peer_lost or (op.remote is not None and isinstance(err, E.PeerDisconnected))
            ids = op.answered()
            if op.route == RING:
                if op.ids is None and err is None and type(op.result) is bytes:  # a verified CopyV: a completion per piece
                    c = np.zeros(len(op.result) // 8, COMPLETION_DTYPE)
                    c["id"], c["result"] = ids, np.frombuffer(op.result, "<u8")
                    arrays.append(c)
                elif op.ids is None:
                    comps.append((ids, 0, _result(op.result), 0, 0) if err is None else (ids, err.code, 0, COMPLETION_DETAIL, 0))
                else:
                    c = np.zeros(len(ids), COMPLETION_DTYPE)
                    c["id"] = ids
                    if err is not None:
                        c["status"], c["flags"] = err.code, COMPLETION_DETAIL
                    arrays.append(c)
                if err is not None:
                    codes.extend([err.code] * op.count())
                    replies.extend(P.Reply(int(r), error=err) for r in np.atleast_1d(ids).tolist())
            elif op.ids is None:
                replies.append(P.Reply(ids, op.result if err is None else None, err))
                if err is not None:
                    codes.append(err.code)
            else:
                replies.extend(P.Reply(int(r), None, err) for r in ids)
                if err is not None:
                    codes.extend([err.code] * op.count())
        after = self.control.answer_after(session, [req for req, _ in b.after])
        for (req, route), reply in zip(b.after, after):
            if reply.error is not None:
                codes.append(reply.error.code)
            if route == RING:
                comps.append((req.id, 0, 0, 0, 0))
            else:
                replies.append(reply)
        if replies:
            self.send(session.identity, P.encode_replies(replies))
        if comps or arrays:
            if arrays:
                if comps:
                    arrays.append(np.array(comps, dtype=COMPLETION_DTYPE))
                out = np.empty(sum(len(a) for a in arrays), COMPLETION_DTYPE)  # concatenate would repack the dtype
                at = 0
                for a in arrays:
                    out[at : at + len(a)] = a
                    at += len(a)
                self.rings.push(session, out)
            else:
                self.rings.push(session, comps)
        session.inflight -= b.socket_n
        session.ring_pending -= b.ring_n
        self.accounting.passed(session, b.ops, len(b.waves), codes, b.control)
        if session.worker is not None:
            self.rings.settle(session)  # the ring goes back to its worker once the session is idle
        if peer_lost and session.running:
            self.on_peer_lost(session)  # the producer's NIXL agent is gone: its session goes too


def _on_cpu(batch: Batch, device: Any) -> bool:
    """Whether a pipelined pass is one of this CPU device's (no GPU fence, this device)."""
    return batch.fence is None and batch.pipe is not None and batch.pipe[0] is device


def _soon(token: trio.lowlevel.TrioToken, fn: Callable[..., None], *args: Any) -> None:
    """`fn(*args)` on the loop, from another thread; nothing if the loop has ended (a device
    process answering, or failing what it owed, as the daemon closes)."""
    try:
        token.run_sync_soon(fn, *args)
    except trio.RunFinishedError:
        pass


def _result(value: Any) -> int:
    return int(value) if isinstance(value, (int, np.integer)) else 0
