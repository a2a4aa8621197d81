"""Pipelined passes: a session's passes queued behind one another, each answered once done.

A pass whose ops all run on one lane of one GPU is queued there without waiting (`issue`):
the GPU runs it while the loop takes and queues the next, and the session's completer
(`answer`) answers each once its fence passes. A pass of one CPU device joins the session's
CPU pipeline (`queue_cpu`): sent at once to the device's process where it runs there
(`send_cpu`, the loop told when it is done), else run in turn by the device's worker
(`run_queued`). Answers always go out in the order the passes were taken.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Sequence

import trio

from .. import errors as E
from ..backends import Answer, Then

from ._batch import Batch
from ._ops import Op, fail_ops, in_process
from ._session import Session
from ._waves import device_failed, fail_rest, issue, issue_off_loop, run_stretch, wait_visible

__all__ = ["Pipeline"]

#: Requests whose device work only queues (no kernel to compile, no result to wait for).
_QUEUES_AT_ONCE = frozenset(("copy", "copyv", "fill"))
#: How long a pipelined pass's fence is polled from the loop before a worker waits for it.
_POLL_S = 500e-6
#: How long a worker runs a session's queued CPU passes before it lets other sessions have it.
_CPU_SLICE_S = 0.02
#: A session's passes queued in a CPU device's process: one running, one waiting behind it.
_AHEAD = 2


class Pipeline:
    """The pipelining of one daemon's passes (`Pass` owns it)."""

    def __init__(self, pass_: Any) -> None:
        #: The pass: it completes and accounts, holds the limiters, says when a session stopped.
        self.pass_ = pass_

    async def enqueue(self, session: Session, batch: Batch) -> bool:
        """Queue a one-lane pass without waiting for it; the session's completer answers it.

        The GPU then runs this pass while the loop takes and queues the next: the engine does
        not idle for a round trip per pass. A CPU pass is queued as planned, and sent to the
        device's process at once where it runs there (`send_cpu`), else run in turn by the
        device's worker (`run_queued`): the CPU does not idle while the loop plans and
        answers. Returns False if it ran to completion instead."""
        assert batch.pipe is not None
        if session.pipeline and session.pipeline[-1].pipe != batch.pipe:
            await self.drain(session)  # another lane or device: nothing would order the two
        device, lane = batch.pipe
        if device.kind != "gpu":
            self.queue_cpu(session, batch)
            return True
        try:
            if all(op.kind in _QUEUES_AT_ONCE and (batch.inline or not op.host_only) for op in batch.ops) and device.backend.all_pinned():
                batch.fence = issue(batch.waves, device, lane)  # cudaMemcpyAsync from pinned pages: returns at once
            else:  # kernels (may compile), checksums (wait for a result), pinning: off the loop
                batch.fence = await trio.to_thread.run_sync(issue_off_loop, batch.waves, device, lane, limiter=self.pass_.limiters[device.index])
        except Exception as exc:  # recording the fence failed: the device is in trouble
            device_failed(batch.ops, f"queueing on {device}", exc)
            return False
        device.completed += 1
        session.pipeline.append(batch)
        session.pipeline_wake.set()
        self.pass_.accounting.counters["pipelined_passes"] += 1
        return True

    def queue_cpu(self, session: Session, batch: Batch) -> None:
        """A CPU pass joins the session's pipeline, and is sent to the device's process at
        once if it can be (`send_cpu`); else the completer runs it in turn."""
        device = batch.pipe[0]  # type: ignore[index]
        device.queued_bytes += sum(op.cost for op in batch.ops)
        session.pipeline.append(batch)
        session.pipeline_wake.set()
        self.pass_.accounting.counters["pipelined_passes"] += 1
        self.send_cpu(session, device)

    async def drain(self, session: Session) -> None:
        """Wait until every pipelined pass of the session has been answered."""
        while session.pipeline:
            await session.pipeline_moved.wait()

    async def answer(self, session: Session) -> None:
        """The session's completer: answers pipelined passes in order, each once its fence passes."""
        while True:
            if not session.pipeline:
                await session.pipeline_wake.wait()
                session.pipeline_wake = trio.Event()
                continue
            batch = session.pipeline[0]
            if batch.fence is None:  # CPU passes: run them, in order; each is answered as it ends
                with trio.CancelScope(shield=True):  # what was sent or started finishes
                    await self.run_cpu(session, batch.pipe[0])
                continue
            with trio.CancelScope(shield=True):  # issued work finishes: its memory is in use until then
                # Look between the loop's other work for a while (a query is a microsecond, a
                # thread hop tens), then let a worker wait for long work.
                give_up = time.perf_counter() + _POLL_S
                while not wait_visible(batch.fence, batch.ops, block=False):
                    if time.perf_counter() > give_up:
                        await trio.to_thread.run_sync(wait_visible, batch.fence, batch.ops, limiter=self.pass_.waiters)
                        break
                    await trio.lowlevel.checkpoint()
            session.pipeline.popleft()
            self.pass_.complete(batch)
            moved, session.pipeline_moved = session.pipeline_moved, trio.Event()
            moved.set()

    def send_cpu(self, session: Session, device: Any) -> None:
        """(On the loop.) Send the session's next pipelined passes to the CPU device's process,
        while fewer than `_AHEAD` are there and each runs wholly there, without waiting: the
        process goes from one to the next while the loop plans and answers, and the loop is
        told when each is done (as it reads the process's answers; `sent_done`). A pass
        the process cannot take now is left part-sent: the completer has a thread send the
        rest (`run_cpu`), and nothing is sent behind it meanwhile."""
        sent, pipeline = session.sent, session.pipeline
        while len(sent) < _AHEAD and len(pipeline) > len(sent):
            if sent and not sent[-1][1].sent_all:
                return
            batch = pipeline[len(sent)]
            if not _on_cpu(batch, device):
                return  # another device's: once these are answered
            new = send_pass(batch.waves, lambda: self.pass_.stopped(session))
            if new is None:
                return  # the daemon runs it: a worker, once these are answered
            sent.append((batch, new))
            if not new.send(False):
                return
            self.when_done(session, new, device)

    def when_done(self, session: Session, sent: Sent, device: Any) -> None:
        """(On the loop.) `sent_done` once the pass's answers are in: called right there when
        the loop itself reads the last one (the process's answers are read on the loop), else
        (a thread read it, or it is in already, while `send_cpu` is still going) soon."""
        token, loop = trio.lowlevel.current_trio_token(), threading.get_ident()
        registered = False

        def done() -> None:
            if registered and threading.get_ident() == loop:
                self.sent_done(session, sent, device)
            else:
                _soon(token, self.sent_done, session, sent, device)

        sent.on_done(done)
        registered = True

    def sent_done(self, session: Session, sent: Sent, device: Any) -> None:
        """(On the loop, as the process's answers are read.) A sent pass is done: answer
        every done pass at the head, in order, right here (no hop to the completer's task),
        and send the next ones."""
        sent.done = True
        queue = session.sent
        while queue and queue[0][1].done:
            batch, done = queue.popleft()
            done.end()
            batch.ran = True
            self.answer_ran(session, batch)
        self.send_cpu(session, device)
        session.pipeline_wake.set()  # the completer: a pass a worker runs, or a send to finish

    async def run_cpu(self, session: Session, device: Any) -> None:
        """The completer's share of a session's CPU passes, in order. Passes sent to the
        device's process (`send_cpu`) are answered when the loop is told they are done
        (`sent_done`): no thread waits for them, so a small compute costs no thread hop.
        Here: a pass the process could not take at once is sent by a thread, and a pass
        the daemon runs itself (a copy) runs on the device's worker (`run_queued`) once
        those before it are answered."""
        sent, pipeline = session.sent, session.pipeline
        while True:
            self.send_cpu(session, device)
            if sent and not sent[-1][1].sent_all:  # the process could not take it without waiting
                rest = sent[-1][1]
                await trio.to_thread.run_sync(rest.send, True, limiter=self.pass_.waiters)
                self.when_done(session, rest, device)
                continue
            if sent:  # until they are answered, or a new pass comes to send
                session.pipeline_wake = trio.Event()
                await session.pipeline_wake.wait()
                continue
            batch = pipeline[0] if pipeline else None
            if batch is None or not _on_cpu(batch, device):
                return
            await trio.to_thread.run_sync(self.run_queued, session, device, trio.lowlevel.current_trio_token(),
                                          limiter=self.pass_.limiters[device.index])

    def run_queued(self, session: Session, device: Any, token: trio.lowlevel.TrioToken) -> None:
        """A worker thread: the session's queued CPU passes that the daemon runs itself, in
        order, until one that runs in the device's process comes (the loop sends those), none
        is left, or its slice of the device's worker is used up. Each is answered on the loop
        as it ends, while this thread goes on to the next one the loop planned meanwhile."""
        give_up = time.perf_counter() + _CPU_SLICE_S
        stop = lambda: self.pass_.stopped(session)  # noqa: E731
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
            token.run_sync_soon(self.answer_ran, session, batch)

    def answer_ran(self, session: Session, batch: Batch) -> None:
        """On the loop: a pipelined CPU pass has run; answer it. It is the pipeline's head: one
        worker at a time runs a session's passes, in order, and these calls come in order."""
        session.pipeline.popleft()
        device = batch.pipe[0]  # type: ignore[index]
        device.queued_bytes -= sum(op.cost for op in batch.ops)
        device.completed += 1
        self.pass_.complete(batch)
        moved, session.pipeline_moved = session.pipeline_moved, trio.Event()
        moved.set()


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


class Sent:
    """A pass whose every op runs in a CPU device's process (`Op.begin`), sent there in order
    and answered later. The event loop sends what the process takes without waiting
    (`send(False)`) and a worker thread the rest; `on_done` says when the answers are in,
    and `end` takes them. Passes sent one after another run in that order: one device's
    process runs what it is sent in order, so the waves' order holds too."""

    __slots__ = ("ops", "answers", "done")

    @property
    def sent_all(self) -> bool:
        return len(self.answers) == len(self.ops)

    def __init__(self, ops: list[Op]) -> None:
        self.ops = ops
        #: The answer of each op sent so far, in order (`ops[i]` has `answers[i]`).
        self.answers: list[Answer | Then] = []
        #: Set by the loop once told (`on_done`).
        self.done = False

    def send(self, block: bool) -> bool:
        """Send the ops not sent yet, in order. False if `block` is False and the process
        cannot take the next one now (nothing of that op was sent; ask again, blocking)."""
        ops, answers = self.ops, self.answers
        while len(answers) < len(ops):
            op = ops[len(answers)]
            try:
                answers.append(op.begin(block))  # type: ignore[misc]
            except BlockingIOError:
                return False
            except Exception as exc:
                fail_ops([op], exc)
                answers.append(Answer.ready(None))
        return True

    def on_done(self, callback: Callable[[], None]) -> None:
        """`callback()` once every op sent is answered (at once if none was), on the thread
        that sets the last answer (the loop, or a thread reading a process's answers), so it must be thread-safe.
        Counted, not just the last op's: an op that failed to send is answered at once,
        while ops before it may still run."""
        answers = self.answers
        if not answers:
            callback()
            return
        left = [len(answers)]
        lock = threading.Lock()

        def one() -> None:
            with lock:
                left[0] -= 1
                last = not left[0]
            if last:
                callback()

        for answer in answers:
            answer.on_done(one)

    def end(self) -> None:
        """(Once answered.) Each op's result or error."""
        for op, answer in zip(self.ops, self.answers):
            try:
                result = answer()
            except Exception as exc:
                fail_ops([op], exc)
            else:
                if op.error is None:
                    op.result = result


def send_pass(waves: Sequence[Sequence[Op]], stop: Callable[[], E.TransferError | None] | None) -> Sent | None:
    """A pass to send to its CPU device's process (`Sent`; nothing sent yet), if every op of
    it runs there; else None (it runs in the daemon: `run_stretch`). If `stop()` gives an
    error, every op fails with it and nothing will be sent."""
    ops = [op for wave in waves for op in wave]
    if not in_process(ops):
        return None
    why = stop() if stop is not None else None
    if why is not None:
        fail_rest(waves, why)
        return Sent([])
    return Sent(ops)
