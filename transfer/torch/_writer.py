"""The worker side: the user's dataset, writing each batch straight into a slot.

`SlotDataset` is what torch's worker processes index. A task is
`(seq, slot, indices)`: the trainer chose the slot (see `_slots`), the worker
fetches the samples and writes each one into its place in that slot. What
goes back through torch's result queue is four integers, never sample bytes.

Two ways to reach the trainer, chosen by the loader (`Plan.mode`):

* ``view``: the daemon runs inside the trainer's process, which can read any
  segment the daemon maps. Each worker keeps one segment of `slots` slots and
  writes batch slot `s` into its own slot `s`; the trainer's batch is a view
  of those bytes. No copy after the sample lands, no request per batch.
* ``copy``: the trainer cannot map the worker's memory (a separate daemon), or
  the batch must end on a GPU. The trainer owns the destination (a host
  segment, or a device buffer) and shares it; the worker writes into a pool
  slot of its own and asks the daemon to copy it to destination slot `s`,
  waiting until the copy is done, so the trainer never sees a partial batch.
"""

from __future__ import annotations

import multiprocessing.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..client import connect
from ._spec import SampleSpec

__all__ = ["Plan", "SlotDataset"]


@dataclass(frozen=True)
class Plan:
    """Everything a worker needs to find its slots (picklable, for spawned workers too)."""

    endpoint: str
    mode: str  # "view" or "copy"
    batch_size: int
    slots: int
    stride: int  # bytes between slot starts (page-aligned)
    slot_nbytes: int
    dest_token: bytes | None = None  # copy mode: the trainer's destination, shared
    timeout: float = 60.0  # a worker's wait for a slot or a copy


class _Writer:
    """One worker process's session with the daemon, and its slot memory."""

    def __init__(self, plan: Plan, spec: SampleSpec) -> None:
        self.plan, self.spec = plan, spec
        self.client = connect(plan.endpoint, name=f"transfer.torch-worker-{os.getpid()}")
        try:
            if plan.mode == "view":
                self.segment = self.client.segment(plan.slots * plan.stride)
                flat = torch.from_numpy(self.segment.buffer)
                self.views = [spec.views(flat[s * plan.stride : s * plan.stride + plan.slot_nbytes], plan.batch_size) for s in range(plan.slots)]
            else:
                assert plan.dest_token is not None
                self.dest = self.client.attach(plan.dest_token)
                self.pool = self.client.pool(plan.slot_nbytes, slots=1)
        except BaseException:
            self.client.close()
            raise

    def write(self, dataset: Any, seq: int, slot: int, indices: list[int]) -> tuple[int, int, int, int]:
        plan = self.plan
        if plan.mode == "view":
            self._fill(self.views[slot], dataset, indices)
            return seq, slot, self.segment.va + slot * plan.stride, len(indices)
        with self.pool.acquire(timeout=plan.timeout) as staging:
            views = self.spec.views(torch.from_numpy(staging.ndarray(plan.slot_nbytes)), plan.batch_size)
            self._fill(views, dataset, indices)
            staging.submit(to=self.dest.va + slot * plan.stride).result(timeout=plan.timeout)
        return seq, slot, 0, len(indices)

    def _fill(self, views: list[torch.Tensor], dataset: Any, indices: list[int]) -> None:
        for k, i in enumerate(indices):
            for view, value in zip(views, self.spec.check(dataset[i], i)):
                view[k].copy_(value)

    def close(self) -> None:
        self.client.close()  # frees the segment or pool with the session


class SlotDataset(torch.utils.data.Dataset):  # type: ignore[misc]
    """The user's map-style dataset, indexed by whole-batch tasks; returns slot descriptors."""

    def __init__(self, dataset: Any, spec: SampleSpec, plan: Plan) -> None:
        self.dataset, self.spec, self.plan = dataset, spec, plan
        self._writer: _Writer | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, task: tuple[int, int, list[int]]) -> tuple[int, int, int, int]:
        if self._writer is None or self._pid != os.getpid():
            self._open()
        assert self._writer is not None
        seq, slot, indices = task
        return self._writer.write(self.dataset, seq, slot, indices)

    def _open(self) -> None:
        # A forked worker inherits the parent's writer object: never use (or close) it here.
        self._writer, self._pid = _Writer(self.plan, self.spec), os.getpid()
        # Worker processes leave through multiprocessing's exit path, which skips atexit but
        # runs these: the session ends cleanly instead of by the daemon's pidfd watch.
        multiprocessing.util.Finalize(None, self._writer.close, exitpriority=10)

    def close_local(self) -> None:
        """Close this process's writer (the trainer's own, when num_workers=0)."""
        if self._writer is not None and self._pid == os.getpid():
            self._writer.close()
        self._writer = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_writer"], state["_pid"] = None, -1  # a spawned worker opens its own
        return state
