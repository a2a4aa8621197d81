"""Schedule and execute: ops cut into hazard-free waves, coalesced, run, made visible.

Ops are placed in *waves*: each in the wave just after the latest one holding
an op it conflicts with (read-after-write, write-after-read, write-after-write
on overlapping ranges), so it runs after every earlier op it conflicts with,
and ops that conflict with nothing before them share the first wave. Inside a
wave nothing conflicts, so
ops may run in any order, on several devices at once, and copies that
continue one another are merged into one. Waves run one after the other, so
the bytes end up exactly as one-at-a-time execution in arrival order would
leave them (tests/unit/server/test_scheduler.py and tests/integration/test_equivalence.py prove it).

Each device's share of a wave ends with the lanes it used synchronized (a
lane is one of the session's device streams): when a wave returns, its work
is visible, and only then may the pass answer it.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from typing import Any, Callable, Sequence

import trio

from .. import errors as E
from ..backends import Span
from ._ops import Op, fail_ops, runs_inline
from ._remotepost import loop_posts, post_remote, post_remote_on_loop, remote_groups, remote_limiter
from ._placement import VirtualDevice

__all__ = ["assign_waves", "coalesce", "run_inline", "run_waves", "run_stretch", "fail_rest", "one_device", "issue", "issue_off_loop", "wait_visible", "device_failed"]


class _Intervals:
    """Disjoint, sorted half-open intervals; inserting merges (a union of ranges)."""

    __slots__ = ("starts", "ends")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []

    def overlaps(self, a: int, b: int) -> bool:
        if a >= b:
            return False
        i = bisect_right(self.starts, a) - 1
        if i >= 0 and self.ends[i] > a:
            return True
        return i + 1 < len(self.starts) and self.starts[i + 1] < b

    def add(self, a: int, b: int) -> None:
        if a >= b:
            return
        starts, ends = self.starts, self.ends
        if not starts or a > ends[-1]:  # the common case: ranges arrive in ascending order
            starts.append(a)
            ends.append(b)
            return
        if a >= starts[-1]:  # touches or overlaps the last interval
            if b > ends[-1]:
                ends[-1] = b
            return
        i = bisect_right(starts, a)
        if i > 0 and ends[i - 1] >= a:  # touches or overlaps the one before
            i -= 1
            a = starts[i]
        j = i
        while j < len(starts) and starts[j] <= b:
            b = max(b, ends[j])
            j += 1
        starts[i:j] = [a]
        ends[i:j] = [b]


#: How many of the latest waves an op may be placed before (`assign_waves`): bounds the work
#: per op; an op that conflicts with none of them goes in the earliest of them.
_LOOKBACK = 8


def assign_waves(ops: Sequence[Op]) -> list[list[Op]]:
    """Place ops (in arrival order) in consecutive waves with no internal hazard.

    Each op goes in the wave just after the latest wave holding an op it conflicts with
    (read-after-write, write-after-read, write-after-write), looking back at most
    `_LOOKBACK` waves: so every op runs after each earlier op it conflicts with, and
    nothing in a wave conflicts. Not simply a new wave at each conflict: a group of
    READs each followed by the sums of what it read is then two waves (the READs, one
    post; then the sums), not two per group."""
    if len(ops) <= 1:
        return [list(ops)] if ops else []
    waves: list[list[Op]] = []
    marks: list[tuple[dict[int, _Intervals], dict[int, _Intervals]]] = []  # per wave: (reads, writes)
    for op in ops:
        w = len(waves)
        lowest = w - _LOOKBACK if w > _LOOKBACK else 0
        while w > lowest and not _conflicts(op, *marks[w - 1]):
            w -= 1
        if w == len(waves):
            waves.append([])
            marks.append(({}, {}))
        waves[w].append(op)
        reads, writes = marks[w]
        for sid, a, b in op.reads:
            iv = reads.get(sid)
            if iv is None:
                iv = reads[sid] = _Intervals()
            iv.add(a, b)
        for sid, a, b in op.writes:
            iv = writes.get(sid)
            if iv is None:
                iv = writes[sid] = _Intervals()
            iv.add(a, b)
    return waves


def _conflicts(op: Op, reads: dict[int, _Intervals], writes: dict[int, _Intervals]) -> bool:
    """Whether `op` conflicts with a wave that read `reads` and wrote `writes`."""
    for sid, a, b in op.reads:
        w = writes.get(sid)
        if w is not None and w.overlaps(a, b):
            return True
    for sid, a, b in op.writes:
        w, r = writes.get(sid), reads.get(sid)
        if (w is not None and w.overlaps(a, b)) or (r is not None and r.overlaps(a, b)):
            return True
    return False


def coalesce(wave: Sequence[Op]) -> list[tuple[list[Op], Callable[[], Any] | None]]:
    """Group a wave's ops into executable units; copies that continue each other become one.

    Safe because nothing in a wave conflicts: order inside a wave is free.
    Returns (ops the unit completes, work) pairs; work None means already failed.
    """
    if len(wave) == 1:
        return [([wave[0]], wave[0].run)]
    units: list[tuple[list[Op], Callable[[], Any] | None]] = []
    copies: dict[tuple[int, int, int], list[tuple[Op, Span, Span]]] = defaultdict(list)  # (op, dst, src)
    for op in wave:
        c = op.copy
        if c is not None:
            copies[(c[0], c[1], op.device.index)].append((op, c[2], c[3]))
        else:
            units.append(([op], op.run))
    for group in copies.values():
        group.sort(key=lambda e: e[1].offset)
        run = [group[0]]
        for entry in group[1:]:
            _, last_dst, last_src = run[-1]
            _, dst, src = entry
            if dst.offset == last_dst.offset + last_dst.nbytes and src.offset == last_src.offset + last_src.nbytes:
                run.append(entry)
            else:
                units.append(_merged(run))
                run = [entry]
        units.append(_merged(run))
    return units


def _merged(run: list[tuple[Op, Span, Span]]) -> tuple[list[Op], Callable[[], Any] | None]:
    """One unit of the copies in `run` ((op, dst, src), each continuing the one before)."""
    ops = [op for op, _, _ in run]
    if len(run) == 1:
        return ops, ops[0].run
    _, first_dst, first_src = run[0]
    total = sum(dst.nbytes for _, dst, _ in run)
    dst = first_dst._replace(nbytes=total)
    src = first_src._replace(nbytes=total)
    backend = ops[0].device.backend
    return ops, lambda: backend.copy(dst, src)


def _run_units(units: Sequence[tuple[list[Op], Callable[[], Any] | None]], device: VirtualDevice, visible: bool = True) -> None:
    backend = device.backend
    lanes = set()
    for ops, work in units:
        if work is None:
            continue
        lane = ops[0].lane
        lanes.add(lane)
        try:
            with backend.lane(lane):
                result = work()
        except Exception as exc:  # a backend failure fails these requests, not the daemon
            fail_ops(ops, exc)
            continue
        for op in ops:
            op.result = result
    if not visible:
        return  # queued only: a fence on the lane says when (`issue`)
    try:
        # Visible before answered: queued device work is not done work. Only these lanes:
        # other sessions' work on the device runs on.
        for lane in lanes:
            backend.synchronize_lane(device.local_id, lane)
    except Exception as exc:
        device_failed([op for ops, _ in units for op in ops], f"synchronizing {device}", exc)


def device_failed(ops: Sequence[Op], doing: str, exc: BaseException) -> None:
    """The device failed under these ops (a synchronize, a fence): they fail with why, and
    the daemon serves on. An op that already failed keeps its own error."""
    err = E.BackendError(f"{doing}: {type(exc).__name__}: {exc}")
    for op in ops:
        op.error = op.error or err


def issue(waves: Sequence[Sequence[Op]], device: VirtualDevice, lane: Any) -> Any:
    """Queue a pipelined pass (all its ops on one lane of one GPU) without waiting for it.

    Stream order keeps its waves in order on the device; host work among them waits for the
    device work it touches (`_stream`). Returns the lane's fence: answer once it is passed."""
    for wave in waves:
        _run_units(coalesce(wave), device, visible=False)
    return device.backend.fence(device.local_id, lane)


def issue_off_loop(waves: Sequence[Sequence[Op]], device: VirtualDevice, lane: Any) -> Any:
    """`issue` on a worker thread (it may pin segments, compile kernels, wait for results)."""
    with device.backend.off_loop():
        return issue(waves, device, lane)


def wait_visible(fence: Any, ops: Sequence[Op], block: bool = True) -> bool:
    """Whether a pipelined pass's work is done (`block`: wait for it, a worker's job).
    A device error fails its ops (and counts as done)."""
    try:
        if not block:
            return bool(fence.done())
        fence.wait()
    except Exception as exc:
        device_failed(ops, f"synchronizing {ops[0].device if ops else 'a device'}", exc)
    return True


def _run_wave_inline(wave: Sequence[Op]) -> None:
    """Execute one wave on the calling thread (small work: cheaper than a thread hop)."""
    if len(wave) == 1 and wave[0].remote is None:
        _run_units(coalesce(wave), wave[0].device)
        return
    by_device: dict[int, list[Op]] = defaultdict(list)
    wave, groups = remote_groups(wave)
    for group in groups:
        post_remote(group)
    for op in wave:
        by_device[op.device.index].append(op)
    for ops in by_device.values():
        _run_units(coalesce(ops), ops[0].device)


def run_inline(waves: Sequence[Sequence[Op]]) -> None:
    """Execute waves on the calling thread (the event loop): small work, cheaper than a thread hop."""
    for wave in waves:
        _run_wave_inline(wave)


def one_device(wave: Sequence[Op]) -> VirtualDevice | None:
    """The device a wave's work all runs on (no remote copies, one device), else None."""
    device = wave[0].device
    for op in wave:
        if op.device is not device or op.remote is not None:
            return None
    return device


async def run_waves(
    waves: Sequence[Sequence[Op]],
    limiters: dict[int, trio.CapacityLimiter],
    inline_bytes: int,
    stop: Callable[[], E.TransferError | None] | None = None,
) -> None:
    """Run waves in order; inside a wave, each device's share runs on that device's worker.

    Consecutive waves that all run on one device (a graph's nodes, a chain of computes)
    are a *stretch*: one worker call runs them one after another, each made visible as
    it ends, instead of a round trip between the loop and the worker per wave (on 2 cores
    each cost ~150 us, more than a small layer's math). A stretch whose work is at most
    `inline_bytes` runs on the loop. A wave's remote copies are posted as NIXL transfers
    per (peer, direction), concurrently with the wave's local work: from the loop in posts
    of at most max(2 * inline_bytes, 1 MiB) (`_remotepost.loop_posts`), an op larger than that on a
    worker thread (a same-host READ copies inside the post). Before each wave `stop()` may
    give an error: the waves not yet started fail with it instead (a wave already
    running finishes).
    """
    k = 0
    while k < len(waves):
        why = stop() if stop is not None else None
        if why is not None:
            fail_rest(waves[k:], why)
            return
        device = one_device(waves[k])
        if device is not None:
            j = k + 1
            while j < len(waves) and one_device(waves[j]) is device:
                j += 1
            stretch, k = waves[k:j], j
            if runs_inline((op for wave in stretch for op in wave), inline_bytes):
                for wave in stretch:
                    _run_units(coalesce(wave), device)
            else:
                nbytes = sum(op.cost for wave in stretch for op in wave)
                await _on_device(stretch, device, nbytes, limiters[device.index], stop)
            continue
        wave = waves[k]
        k += 1
        by_device: dict[int, list[Op]] = defaultdict(list)
        wave, groups = remote_groups(wave)
        for op in wave:
            by_device[op.device.index].append(op)
        jobs: list[Any] = []
        small: list[list[Op]] = []
        big: list[list[Op]] = []
        limit = max(2 * inline_bytes, 1 << 20)
        for group in groups:
            for part in loop_posts(group, limit):
                (small if sum(o.nbytes for o in part) <= limit else big).append(part)
        if small:
            jobs.append((small, None, -1))  # posted from the loop, one after another
        if big:
            jobs.append((big, None, 0))
        for ops in by_device.values():
            device = ops[0].device
            if runs_inline(ops, inline_bytes):
                _run_units(coalesce(ops), device)
            else:
                jobs.append(([ops], device, sum(o.cost for o in ops)))
        if not jobs:
            continue
        if len(jobs) == 1:
            units, device, nbytes = jobs[0]
            await _on_device(units, device, nbytes, None if device is None else limiters[device.index])
            continue
        async with trio.open_nursery() as nursery:
            for units, device, nbytes in jobs:
                nursery.start_soon(_on_device, units, device, nbytes, None if device is None else limiters[device.index])


def fail_rest(waves: Sequence[Sequence[Op]], why: E.TransferError) -> None:
    for wave in waves:
        for op in wave:
            if op.error is None:
                op.error = why


def run_stretch(waves: Sequence[Sequence[Op]], device: VirtualDevice,
                stop: Callable[[], E.TransferError | None] | None) -> None:
    """A worker thread's share: waves on its device, in order, each made visible as it ends.
    (It may block on slow driver calls: pinning a segment.) `stop` is asked before each wave,
    as the loop would ask it: it reads the session's state, which only the loop changes."""
    with device.backend.off_loop():
        for i, wave in enumerate(waves):
            why = stop() if stop is not None else None
            if why is not None:
                fail_rest(waves[i:], why)
                return
            _run_units(coalesce(wave), device)


async def _on_device(waves: Any, device: VirtualDevice | None, nbytes: int, limiter: trio.CapacityLimiter | None,
                     stop: Callable[[], E.TransferError | None] | None = None) -> None:
    if device is None:  # the wave's remote groups (waves): one NIXL post each
        for i, group in enumerate(waves):
            if nbytes < 0:
                if i:
                    # Other tasks run between two posts from the loop (each is <= ~80 us of
                    # copying); not cancellable: every group of the wave is posted, or failed.
                    await trio.lowlevel.cancel_shielded_checkpoint()
                await post_remote_on_loop(group)
            else:
                await trio.to_thread.run_sync(post_remote, group, limiter=remote_limiter())
        return
    device.queued_bytes += nbytes
    try:
        await trio.to_thread.run_sync(run_stretch, waves, device, stop, limiter=limiter)
    finally:
        device.queued_bytes -= nbytes
        device.completed += 1
