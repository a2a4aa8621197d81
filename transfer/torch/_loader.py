"""`TransferLoader`: a DataLoader whose batches are shared-memory slots, not pickled copies.

Underneath is a stock `torch.utils.data.DataLoader` with `batch_size=None`:
its workers, sampler, ordering, error propagation, crash detection, timeout
and shutdown are PyTorch's, unchanged. What changes is what a task is (a
batch's sample indices plus the slot to write them into) and what travels
back (four integers). The trainer turns those into a tensor over the slot.

The lifetime rule. A batch is valid until you ask for the `hold`-th batch
after it (`hold=1`: until the next `next()`); then its slot may be rewritten.
`.clone()` what you keep longer. This is enforced, not hoped for: the trainer
picks the slot of every task as torch dispatches it (`_Slots.take`), from
slots no delivered batch still holds, and there are exactly enough slots for
torch's prefetch window (`num_workers * prefetch_factor`) plus `hold`. If a
future torch ever dispatched further ahead, `take` raises instead of letting
a worker overwrite a batch in use. On a GPU, a released slot is reused only
after the work the trainer queued on the current CUDA stream up to the
release has finished (an event per slot), so async kernels reading a batch
are not overwritten by the daemon's next copy.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from .. import errors as E
from ..client import connect
from ..server import EmbeddedDaemon, serve_in_process
from ._spec import SampleSpec
from ._writer import Plan, SlotDataset

__all__ = ["TransferLoader"]

_PAGE = 4096


class _Slots:
    """Which batch slots are free, held by the trainer, or being written (trainer side)."""

    def __init__(self, count: int, cuda: bool) -> None:
        self.count = count
        self.free: deque[int] = deque(range(count))
        self.held: deque[int] = deque()  # delivered, oldest first
        self.writing: set[int] = set()  # dispatched, not yet delivered
        self._cuda = cuda
        self._events: dict[int, Any] = {}

    def take(self) -> int:
        if not self.free:
            raise RuntimeError(
                f"transfer.torch: all {self.count} batch slots are in use (held {len(self.held)}, being written "
                f"{len(self.writing)}): this torch prefetches further ahead than num_workers * prefetch_factor; "
                f"raise `hold` to get spare slots"
            )
        slot = self.free.popleft()
        ev = self._events.pop(slot, None)
        if ev is not None:
            ev.synchronize()  # the trainer's queued reads of this slot's last batch are done
        self.writing.add(slot)
        return slot

    def deliver(self, slot: int) -> None:
        self.writing.discard(slot)
        self.held.append(slot)

    def release_to(self, keep: int) -> None:
        while len(self.held) > keep:
            slot = self.held.popleft()
            if self._cuda:
                ev = torch.cuda.Event()
                ev.record()  # on the current stream: what the trainer queued on this batch so far
                self._events[slot] = ev
            self.free.append(slot)

    def new_epoch(self) -> None:
        """Tasks of an earlier epoch that were never delivered are finished or dropped: free."""
        self.free.extend(sorted(self.writing))
        self.writing.clear()


class _Tasks(Sampler):  # type: ignore[misc]
    """The batch sampler, numbered, with a slot chosen for each batch as torch dispatches it."""

    def __init__(self, batches: Any, slots: _Slots) -> None:
        self.batches, self.slots = batches, slots

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[int, int, list[int]]]:
        # Runs at the epoch's first dispatch: after torch drained (persistent workers) or
        # joined (otherwise) the workers of the epoch before, so their slots are free.
        self.slots.new_epoch()
        for seq, indices in enumerate(self.batches):
            yield seq, self.slots.take(), list(indices)


def _descriptor(x: Any) -> Any:
    return x  # the collate function: four integers need no collating


class _Resources:
    """What a loader must give back, apart from the loader object (for weakref.finalize)."""

    def __init__(self) -> None:
        self.inner: Any = None  # the live torch iterator
        self.dataset: SlotDataset | None = None
        self.client: Any = None
        self.daemon: EmbeddedDaemon | None = None  # only one this loader started

    def end_iteration(self) -> None:
        inner, self.inner = self.inner, None
        shutdown = getattr(inner, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()  # joins the workers: nothing writes into a slot after this

    def close(self) -> None:
        try:
            self.end_iteration()
        finally:
            if self.dataset is not None:
                self.dataset.close_local()
            if self.client is not None:
                self.client.close()
                self.client = None
            if self.daemon is not None:
                self.daemon.close()
                self.daemon = None


def _finalize(res: _Resources) -> None:
    """A loader nobody closed: the garbage collector may call this on any thread, the embedded
    daemon's own, or one inside some trio run. Closing blocks (it waits for the daemon), so
    it runs on a thread of its own, joined unless this is the daemon's thread."""
    worker = threading.Thread(target=res.close, name="transfer-loader-close", daemon=True)
    worker.start()
    daemon_thread = getattr(res.daemon, "_thread", None)
    if threading.current_thread() is not daemon_thread:
        worker.join(60)


class TransferLoader:
    """A `DataLoader` drop-in whose workers write samples into shared-memory batch slots.

    `dataset` is map-style, and every sample has the same layout: a tensor or
    ndarray, or a tuple/list of tensors, ndarrays and numbers (`spec`, default:
    the layout of `dataset[0]`). Batches come back as tensors (a list of
    tensors for tuple samples, like `default_collate`) on `device`.

    `daemon`: None starts a daemon in this process (closed with the loader);
    an `EmbeddedDaemon` is used as is; an endpoint string connects to a
    separate `transferd` (CPU batches only, copied once by the daemon into
    this process's segment). `device="cuda"` needs a daemon in this process
    with a GPU backend: the daemon copies each slot into a device buffer and
    the batch comes through DLPack. `backend` and `daemon_options` (keyword
    arguments of `serve_in_process`, e.g. `shm_dir`) configure the daemon the
    loader starts. `hold`: how many batches stay valid at once.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Any = None,
        batch_sampler: Sampler | Any = None,
        num_workers: int = 0,
        *,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Any = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        spec: SampleSpec | None = None,
        device: str | torch.device = "cpu",
        daemon: EmbeddedDaemon | str | None = None,
        backend: str = "auto",
        daemon_options: dict[str, Any] | None = None,
        hold: int = 1,
        pin_memory: bool = False,
        collate_fn: Any = None,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
            raise TypeError("TransferLoader takes a map-style dataset (with __getitem__ and __len__); an IterableDataset decides its own batches")
        if batch_size is None and batch_sampler is None:
            raise TypeError("TransferLoader always batches: give batch_size (or batch_sampler); batch_size=None is the stock DataLoader's job")
        if hold < 1:
            raise ValueError("hold must be at least 1 (the batch you were just given)")
        if collate_fn is not None:
            raise TypeError("TransferLoader collates samples into its shared-memory slots itself (SampleSpec), so a "
                            "collate_fn has nowhere to run: transform samples in the dataset's __getitem__ instead")
        if not isinstance(pin_memory, bool):
            raise TypeError(f"pin_memory: True or False, got {pin_memory!r}")
        # pin_memory (the stock DataLoader's) is accepted and changes nothing: batches are already in
        # shared memory that a GPU daemon page-locks for DMA, and device="cuda" copies them there.
        self.dataset = dataset
        self.device = torch.device(device)
        self.hold = hold
        self.num_workers = num_workers
        self.prefetch_factor = (2 if prefetch_factor is None else prefetch_factor) if num_workers > 0 else None
        if batch_sampler is None:
            if sampler is None:
                sampler = RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
            elif shuffle:
                raise ValueError("sampler option is mutually exclusive with shuffle")
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        elif batch_size not in (1, None) or shuffle or sampler is not None or drop_last:
            raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
        self.batch_sampler = batch_sampler
        self.batch_size = int(getattr(batch_sampler, "batch_size", batch_size) or batch_size)
        self.spec = spec if spec is not None else SampleSpec.like(dataset[0])

        window = num_workers * self.prefetch_factor if self.prefetch_factor is not None else 1  # None: no workers
        self.slots_count = window + hold
        slot_nbytes = self.spec.slot_nbytes(self.batch_size)
        stride = -(-slot_nbytes // _PAGE) * _PAGE
        cuda = self.device.type == "cuda"
        self._slots = _Slots(self.slots_count, cuda=cuda and torch.cuda.is_available())
        self._res = _Resources()
        self._finalizer = weakref.finalize(self, _finalize, self._res)
        try:
            self._setup(daemon, dict(daemon_options or {}, backend=backend), cuda, slot_nbytes, stride)
        except BaseException:
            self.close()
            raise
        self._loader = DataLoader(
            self._res.dataset, batch_size=None, sampler=_Tasks(batch_sampler, self._slots),
            num_workers=num_workers, collate_fn=_descriptor, timeout=timeout, worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context, generator=generator,
            prefetch_factor=self.prefetch_factor, persistent_workers=persistent_workers,
        )

    def _setup(self, daemon: EmbeddedDaemon | str | None, options: dict[str, Any], cuda: bool, slot_nbytes: int, stride: int) -> None:
        if daemon is None:
            daemon = self._res.daemon = serve_in_process(**options)
        self._daemon = daemon if isinstance(daemon, EmbeddedDaemon) else None
        endpoint = daemon.endpoint if isinstance(daemon, EmbeddedDaemon) else daemon
        self._stride, self._slot_nbytes = stride, slot_nbytes
        if cuda:
            if self._daemon is None:
                raise ValueError("device='cuda' needs the daemon in this process (daemon=None or an EmbeddedDaemon): batches come through DLPack")
            if not any(d.kind == "gpu" for d in self._daemon.server.devices):
                raise ValueError(f"device='cuda', but the daemon has no GPU (backend {self._daemon.config.backend!r}); use device='cpu'")
            mode = "copy"
        elif self.device.type == "cpu":
            mode = "view" if self._daemon is not None else "copy"
        else:
            raise ValueError(f"device must be 'cpu' or 'cuda', not {self.device}")
        token = None
        if mode == "copy":
            c = self._res.client = connect(endpoint, name="transfer.torch-trainer")
            self._dest = c.alloc(self.slots_count * stride) if cuda else c.segment(self.slots_count * stride)
            token = c.share(self._dest)
            if not cuda:
                flat = torch.from_numpy(self._dest.buffer)
                self._host_slots = [flat[s * stride : s * stride + slot_nbytes] for s in range(self.slots_count)]
        self.mode = "device" if cuda else mode
        plan = Plan(endpoint, mode, self.batch_size, self.slots_count, stride, slot_nbytes, token)
        self._res.dataset = SlotDataset(self.dataset, self.spec, plan)

    # --- iteration ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> "_Iterator":
        if not self._finalizer.alive:
            raise RuntimeError("this TransferLoader is closed")
        if self._res.inner is not None and not self._loader.persistent_workers:
            self._res.end_iteration()  # one live iteration per loader: the old workers stop writing first
        self._res.inner = iter(self._loader)
        return _Iterator(self, self._res.inner)

    def _batch(self, slot: int, va: int, count: int) -> torch.Tensor | list[torch.Tensor]:
        if self.mode == "view":
            assert self._daemon is not None
            try:
                # `.array`, not DLPack: a DeviceView export waits for every device's queued work
                # (a GPU sync per batch), and no device writes these bytes: the worker's CPU did.
                arr = self._daemon.device_array(va, self._slot_nbytes).array
            except E.UnknownSegment:
                raise RuntimeError("transfer.torch: the worker that wrote this batch has gone (its segment is freed)") from None
            flat = torch.from_numpy(arr)
        elif self.mode == "copy":
            flat = self._host_slots[slot]
        else:
            assert self._daemon is not None
            flat = torch.from_dlpack(self._daemon.device_array(self._dest, self._slot_nbytes, np.uint8, offset=slot * self._stride))
        fields = [v[:count] for v in self.spec.views(flat, self.batch_size)]
        return fields[0] if self.spec.single else fields

    # --- the end --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers, free every slot, and stop the daemon if this loader started it."""
        self._finalizer()

    def __enter__(self) -> "TransferLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<TransferLoader {self.spec} batch={self.batch_size} workers={self.num_workers} slots={self.slots_count} {self.mode}>"


class _Iterator:
    """One epoch: batches in order, each a view of its slot until `hold` more are asked for."""

    def __init__(self, loader: TransferLoader, inner: Any) -> None:
        self._loader, self._inner = loader, inner
        self._next_seq = 0
        #: Batches handed out and not yet known gone: (seq, weak references to their tensors).
        self._given: deque[tuple[int, list[weakref.ref[torch.Tensor]]]] = deque()

    def __iter__(self) -> "_Iterator":
        return self

    def __len__(self) -> int:
        return len(self._loader)

    def __next__(self) -> torch.Tensor | Sequence[torch.Tensor]:
        L = self._loader
        L._slots.release_to(L.hold - 1)  # asking for a batch ends the oldest one held
        seq, slot, va, count = next(self._inner)
        if seq != self._next_seq:  # torch delivers in order (in_order=True); say so if not
            raise RuntimeError(f"transfer.torch: batch {seq} arrived where {self._next_seq} was due")
        self._next_seq += 1
        L._slots.deliver(slot)
        self._check_given(seq, L.hold)
        batch = L._batch(slot, va, count)
        self._given.append((seq, [weakref.ref(t) for t in (batch if isinstance(batch, list) else [batch])]))
        return batch

    def _check_given(self, seq: int, hold: int) -> None:
        """A batch kept past its slot's reuse would silently read later batches' bytes
        (`list(loader)`): one still referenced `hold + 1` batches later is an error."""
        given = self._given
        while given and given[0][0] < seq - hold:
            old, refs = given[0]
            if any(r() is not None for r in refs):
                raise RuntimeError(
                    f"transfer.torch: batch {old} is still referenced {seq - old} batches later, but its memory is "
                    f"reused after {hold} (hold={hold}): clone() what you keep (or list(b.clone() for b in loader)), "
                    "or raise hold"
                )
            given.popleft()
