"""What a pass plans: `Op`, one request translated into byte ranges and work.

A leaf module: the planner makes ops, the RDMA plane adds remote work to
them, the waves execute them, and the pass answers them. Nothing here
touches memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .. import errors as E
from ..addressing import SegmentKind
from ..backends import Answer, Span, Then
from ._placement import VirtualDevice

__all__ = ["Op", "Range", "Staged", "fail_ops", "in_process", "lane_of", "runs_inline", "SOCKET", "RING", "LANES_PER_SESSION"]

Range = tuple[int, int, int]  # (segment id, start offset, end offset)

#: Where an op's answer goes: a reply frame on the control socket, or a completion on the ring.
SOCKET, RING = 0, 1

#: Device streams a session's requests spread over: the `stream` field picks one, modulo this
#: (a hostile client cannot make the daemon create streams without bound).
LANES_PER_SESSION = 4


def lane_of(owner: Any, stream: int) -> tuple[Any, int]:
    """The lane (a device stream of the session's own) a request's `stream` field names."""
    return (owner, stream % LANES_PER_SESSION)


@dataclass(slots=True, eq=False)
class Op:
    """One planned request: what it touches, where it runs, how, and whom it answers."""

    rid: int
    reads: list[Range]
    writes: list[Range]
    device: VirtualDevice
    nbytes: int
    #: The work, run where the wave runs it. None for a remote copy: its wave posts it with
    #: the wave's other remote copies (`remote`, `_waves._post_remote`).
    run: Callable[[], Any] | None = None
    #: Plain copies keep their spans so a wave can merge them.
    copy: tuple[int, int, Span, Span] | None = None  # (dst segment id, src segment id, dst, src)
    result: Any = None
    error: E.TransferError | None = None
    #: Every request id this op answers when it answers more than `rid` (a run of copies
    #: planned as one vector): a list or a uint64 array, `rid` first.
    ids: Any = None
    #: The request kind, for metrics ("copy", "fill", "compute", ...).
    kind: str = "copy"
    #: Extra state an op keeps for its execution (a staging buffer's registration).
    info: Any = None
    #: Copies to or from a remote (NIXL) segment: posted with the rest of the wave's, as one transfer.
    remote: Any = None
    #: SOCKET or RING: where the answer goes. Internal ops (a staging pull) have rid 0.
    route: int = SOCKET
    #: Bytes of work when it exceeds `nbytes` (a compute's elements; stride 0 repeats memory).
    work: int = 0
    #: The device stream it is queued on (`lane_of`); None: the device's default lane.
    lane: Any = None
    #: Every byte it touches is host memory: on a stream backend it runs on the CPU, at once.
    host_only: bool = False
    #: `run` in two halves, set where the work runs outside the daemon (a CPU device's process,
    #: `Backend.out_of_process`): begin(block) sends it there and returns its `Answer`. The
    #: loop sends such passes without waiting and is told when they are done, queueing the
    #: next meanwhile (`_waves.Sent`); it never runs them inline (`runs_inline`). None: run()
    #: only, in the daemon.
    begin: Callable[[bool], Answer | Then] | None = None

    @property
    def cost(self) -> int:
        """What decides inline or a worker, in bytes copied: the larger of the bytes touched
        and the element work. An op that writes nothing (a checksum, a verified remote copy's
        sums) counts its bytes half: it only reads them, where a copy reads and writes each
        (cold, 256 KiB summed in 20 us against 35 us copied)."""
        n = self.nbytes if self.writes else self.nbytes >> 1
        return n if n >= self.work else self.work

    def answered(self) -> Any:
        """The ids this op answers (an int, or a sequence for a vector of copies)."""
        return self.rid if self.ids is None else self.ids

    def count(self) -> int:
        return 0 if self.rid == 0 else (1 if self.ids is None else len(self.ids))


def runs_inline(ops: Iterable[Op], inline_bytes: int) -> bool:
    """The one inline rule (`--inline-bytes`): work whose `Op.cost`, summed over what runs
    together, is at most `inline_bytes` runs on the event loop; more goes to a worker. Never
    work that runs in another process (`Op.begin`: a CPU device's kernels): the loop would
    only wait for it, behind whatever that process runs for other sessions (and the loop reads
    its answers: it would wait for itself). That includes a compute whose inputs are pulled
    first (no `begin`: it runs whole, after the pulls). A copy on such a device runs in the
    daemon: it may run inline."""
    cost = 0
    for op in ops:
        if op.begin is not None or (op.kind == "compute" and op.device is not None and op.device.backend.out_of_process):
            return False
        cost += op.cost
    return cost <= inline_bytes


def in_process(ops: Iterable[Op]) -> bool:
    """Whether every op runs outside the daemon (`Op.begin`: a CPU device's process), so the
    loop sends the pass there instead of a worker running it (`_waves.send_pass`)."""
    return all(op.begin is not None for op in ops)


class Staged:
    """A staging buffer seen as a host segment (for spans and hazard ranges)."""

    kind = SegmentKind.HOST

    def __init__(self, array: np.ndarray) -> None:
        self.id = -next(_staging_ids)
        self.array = array
        self.handle = self
        self.device = -1


_staging_ids = itertools.count(1)


def fail_ops(ops: Sequence[Op], exc: BaseException) -> None:
    """The ops fail with `exc`: their own error, or a backend's failure as `BackendError`."""
    err = E.as_transfer_error(exc)
    for op in ops:
        op.error = err
