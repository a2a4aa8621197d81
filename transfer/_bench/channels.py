"""One producer/consumer channel per method.

Every channel gives the producer a writable uint8 ``buffer`` of
``cell.buffer_bytes`` (``depth`` slots of ``batch`` items of ``size`` bytes),
or, where the transport owns the memory (iceoryx2), a ``loan(slot)`` that
returns views of memory loaned for the next group, and moves one *group*
(one slot: ``batch`` items) per ``submit``. The consumer
side (absent for ``transfer``: the daemon is the consumer) hands the generic
consumer loop uint8 views of the received items; the loop copies them into a
"device" buffer and checksums them exactly as the daemon does for
``transfer``. In ``remote`` mode (``nixl-raw``) the channel itself READs the
group into the consumer's registered device buffer over NIXL, and the loop
only checksums. Completions come back as ``(group, ok)``.

Plumbing (endpoints, pipes, queues) is created by the coordinator with
:func:`make_plumbing` and passed to the processes as arguments.
"""

from __future__ import annotations

import mmap
import os
import pickle
import struct
import uuid
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from ._iceoryx import Iceoryx2Consumer, Iceoryx2Producer, iox_spec
from ._wire import ACK, BYE, HDR, VERIFY, pack_header, unpack_header
from .common import Cell, Consumer, Producer, Received, Spec

if TYPE_CHECKING:
    from transfer._pending import Pending

__all__ = ["PRODUCERS", "CONSUMERS", "VERIFY", "BYE", "HDR", "ACK", "pack_header", "unpack_header", "make_plumbing"]

def make_plumbing(cell: Cell, ctx: BaseContext, run_dir: str, run_id: str,
                  endpoint: str | None) -> tuple[Spec | None, list[Spec]]:
    """(consumer_spec or None, [producer_spec, ...]) for ``cell``; all picklable."""
    P = cell.producers
    m = cell.method
    if m in ("transfer", "transfer-socket"):
        if endpoint is None:
            raise RuntimeError("transfer method needs a daemon endpoint")
        ring = None if m == "transfer" else False  # the default (a ring, same host), or the socket
        return None, [{"endpoint": endpoint, "ring": ring} for _ in range(P)]
    if m in ("zmq-copy", "zmq-zerocopy"):
        data = f"ipc://{run_dir}/zd"
        acks = [f"ipc://{run_dir}/za{i}" for i in range(P)]
        copy = m == "zmq-copy"
        return ({"data": data, "acks": acks, "copy": copy},
                [{"data": data, "ack": acks[i], "copy": copy} for i in range(P)])
    if m == "mp-queue":
        q = ctx.Queue()
        ack_pipes = [ctx.Pipe(duplex=False) for _ in range(P)]  # (reader, writer)
        return ({"queue": q, "acks": [w for _, w in ack_pipes]},
                [{"queue": q, "ack": r} for r, _ in ack_pipes])
    if m == "mp-pipe":
        pipes = [ctx.Pipe(duplex=True) for _ in range(P)]
        return ({"conns": [b for _, b in pipes]}, [{"conn": a} for a, _ in pipes])
    if m == "nixl-raw":
        # One duplex pipe per producer: its NIXL metadata at setup, then group
        # notifications (producer -> consumer) and acks (consumer -> producer).
        pipes = [ctx.Pipe(duplex=True) for _ in range(P)]
        return ({"conns": [b for _, b in pipes], "run_id": run_id},
                [{"conn": a, "run_id": run_id} for a, _ in pipes])
    if m == "torch-mp":
        q = ctx.Queue()  # each producer's shared tensor once, then group headers
        ack_pipes = [ctx.Pipe(duplex=False) for _ in range(P)]
        return ({"queue": q, "acks": [w for _, w in ack_pipes]}, [{"queue": q, "ack": r} for r, _ in ack_pipes])
    if m == "iceoryx2":
        # Nothing to create here: each process opens the cell's services by name. The name is
        # unique per cell; the config keeps iceoryx2's files under the run's directory and names
        # its shared memory after the run id (Runner._remove_shm sweeps it after a kill -9).
        spec = iox_spec(run_dir, run_id, f"{run_id}/{uuid.uuid4().hex[:8]}")
        return spec, [spec for _ in range(P)]
    if m == "shm-pipe":
        note_r, note_w = ctx.Pipe(duplex=False)
        ack_pipes = [ctx.Pipe(duplex=False) for _ in range(P)]
        paths = [f"/dev/shm/{run_id}-shm{i}" for i in range(P)]
        return ({"notify": note_r, "acks": [w for _, w in ack_pipes], "paths": paths},
                [{"notify": note_w, "ack": ack_pipes[i][0], "path": paths[i]} for i in range(P)])
    raise ValueError(f"unknown method {m!r}")


class _AckMixin:
    """Completions over a multiprocessing Connection carrying ACK records."""

    ack_conn: Any

    def poll(self, block: bool) -> list[tuple[int, bool]]:
        out = []
        if block:
            out.append(ACK.unpack(self.ack_conn.recv_bytes()))
        while self.ack_conn.poll(0):
            out.append(ACK.unpack(self.ack_conn.recv_bytes()))
        return [(g, bool(ok)) for g, ok in out]


class ZmqProducer:
    def __init__(self, cell: Cell, idx: int, spec: Spec) -> None:
        import zmq

        self.zmq = zmq
        self.idx = idx
        self.copy = spec["copy"]
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.connect(spec["data"])
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(spec["ack"])
        self.buffer = np.zeros(cell.buffer_bytes, np.uint8)
        self.slots = [[v.data for v in items] for items in _slot_items(self.buffer, cell)]

    def submit(self, g: int, slot: int, verify: bool, expected: Sequence[int] | None) -> None:
        hdr = pack_header(self.idx, g, slot, VERIFY if verify else 0, expected)
        self.push.send_multipart([hdr, *self.slots[slot]], copy=self.copy)

    def poll(self, block: bool) -> list[tuple[int, bool]]:
        out = []
        if block:
            out.append(ACK.unpack(self.pull.recv()))
        while True:
            try:
                out.append(ACK.unpack(self.pull.recv(self.zmq.NOBLOCK)))
            except self.zmq.Again:
                break
        return [(g, bool(ok)) for g, ok in out]

    def bye(self) -> None:
        self.push.send(pack_header(self.idx, -1, 0, BYE, None))

    def close(self) -> None:
        self.push.close(linger=5000)
        self.pull.close(linger=0)
        self.ctx.term()


class QueueProducer(_AckMixin):
    """multiprocessing.Queue; items pickled with protocol 5 (in-band: Queue has no buffer hook)."""

    def __init__(self, cell: Cell, idx: int, spec: Spec) -> None:
        _queue_pickle_protocol_5()
        self.idx = idx
        self.q = spec["queue"]
        self.ack_conn = spec["ack"]
        self.buffer = np.zeros(cell.buffer_bytes, np.uint8)
        self.slots = _slot_items(self.buffer, cell)

    def submit(self, g: int, slot: int, verify: bool, expected: Sequence[int] | None) -> None:
        # The feeder thread pickles later; the slot is not rewritten before its ack.
        self.q.put((self.idx, g, slot, VERIFY if verify else 0, expected, self.slots[slot]))

    def bye(self) -> None:
        self.q.put((self.idx, -1, 0, BYE, None, []))

    def close(self) -> None:
        self.q.close()
        self.q.join_thread()


def _queue_pickle_protocol_5() -> None:
    """Queue's feeder thread pickles with ForkingPickler.dumps(obj), i.e. the default
    protocol (4 on Python 3.11, which copies a NumPy array twice). Make this producer
    process use protocol 5, as a user tuning the Queue path would."""
    from multiprocessing.reduction import ForkingPickler

    if getattr(ForkingPickler, "_bench_p5", False):
        return
    orig = vars(ForkingPickler)["dumps"].__func__  # the classmethod's function

    def dumps(cls: type[ForkingPickler], obj: object, protocol: int | None = 5) -> memoryview:
        out: memoryview = orig(cls, obj, protocol)
        return out

    # A patch of the class (setattr: mypy rightly refuses to assign to a method).
    setattr(ForkingPickler, "dumps", classmethod(dumps))
    setattr(ForkingPickler, "_bench_p5", True)


class PipeProducer(_AckMixin):
    def __init__(self, cell: Cell, idx: int, spec: Spec) -> None:
        self.idx = idx
        self.conn = spec["conn"]
        self.ack_conn = self.conn
        self.buffer = np.zeros(cell.buffer_bytes, np.uint8)
        self.slots = _slot_items(self.buffer, cell)

    def submit(self, g: int, slot: int, verify: bool, expected: Sequence[int] | None) -> None:
        bufs: list[pickle.PickleBuffer] = []
        meta = pickle.dumps((self.idx, g, slot, VERIFY if verify else 0, expected, self.slots[slot]),
                            protocol=5, buffer_callback=bufs.append)
        self.conn.send_bytes(struct.pack("<i", len(bufs)) + meta)
        for b in bufs:
            self.conn.send_bytes(b.raw())

    def bye(self) -> None:
        meta = pickle.dumps((self.idx, -1, 0, BYE, None, []), protocol=5)
        self.conn.send_bytes(struct.pack("<i", 0) + meta)

    def close(self) -> None:
        self.conn.close()


class ShmProducer(_AckMixin):
    """The best a user could write by hand: shared memory + a small pipe message per group."""

    def __init__(self, cell: Cell, idx: int, spec: Spec) -> None:
        self.idx = idx
        self.path = spec["path"]
        self.notify = spec["notify"]
        self.ack_conn = spec["ack"]
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, cell.buffer_bytes)
            self.mm = mmap.mmap(fd, cell.buffer_bytes)
        finally:
            os.close(fd)
        self.buffer = np.frombuffer(self.mm, np.uint8)
        self.buffer[:] = 0

    def submit(self, g: int, slot: int, verify: bool, expected: Sequence[int] | None) -> None:
        self.notify.send_bytes(pack_header(self.idx, g, slot, VERIFY if verify else 0, expected))

    def bye(self) -> None:
        self.notify.send_bytes(pack_header(self.idx, -1, 0, BYE, None))

    def close(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class TorchProducer(_AckMixin):
    """torch.multiprocessing as its users share batches: the producer's buffer is a tensor in
    shared memory (`share_memory_()`), handed to the consumer once through a queue (torch
    passes its file descriptor); then one small queue message per group, acks over a pipe."""

    def __init__(self, cell: Cell, idx: int, spec: Spec) -> None:
        import torch
        import torch.multiprocessing  # noqa: F401 - registers the reductions that share tensors

        self.idx = idx
        self.q = spec["queue"]
        self.ack_conn = spec["ack"]
        self.tensor = torch.zeros(cell.buffer_bytes, dtype=torch.uint8).share_memory_()
        self.buffer: np.ndarray | None = self.tensor.numpy()
        self.q.put((idx, self.tensor))

    def submit(self, g: int, slot: int, verify: bool, expected: Sequence[int] | None) -> None:
        self.q.put(pack_header(self.idx, g, slot, VERIFY if verify else 0, expected))

    def bye(self) -> None:
        self.q.put(pack_header(self.idx, -1, 0, BYE, None))

    def close(self) -> None:
        self.buffer = None


class TransferProducer:
    """``transfer``: only VAs and sizes travel; the daemon moves and checks the bytes.

    ``local`` mode: the batch is written into a HostSegment (shared memory) and
    copied (segment -> DeviceBuffer) by one ``copy_many`` (a ``copy`` per item
    for a group of one).
    ``remote`` mode: the batch is written into a plain NumPy array in this
    process (not shared memory) registered with ``register_remote``; the
    copies are NIXL READs by the daemon into a DeviceBuffer.
    In both, a verified group is one verified ``copy_many`` (``checksum=True``): the
    daemon answers the checksums of what it copied (remote: of what the READ delivered),
    as every other method's consumer checks what it received.
    ``compute`` mode: the daemon checksums each item of the segment in place, always
    (``checksum_many``, or a ``checksum`` per item); a group's requests leave in one
    frame (``c.batch()``).
    """

    def __init__(self, cell: Cell, idx: int, spec: Spec) -> None:
        import transfer

        self.cell = cell
        self.client = transfer.connect(spec["endpoint"], ring=spec.get("ring"))
        self.remote = cell.mode == "remote"
        self.buffer: np.ndarray | None
        if self.remote:
            host = np.zeros(cell.buffer_bytes, np.uint8)
            host[:] = 0  # fault the pages in, as a segment's are
            self.seg = self.client.register_remote(host)
            self.buffer = self.seg.buffer
        else:
            self.seg = self.client.segment(cell.buffer_bytes)
            self.buffer = self.seg.ndarray((cell.buffer_bytes,), np.uint8)
            self.buffer[:] = 0
        # The "device" buffer: one slot's worth, which every group overwrites in turn, as every
        # other method's consumer does (nixl-raw's READs land in one slot-sized buffer too). The
        # daemon runs a session's requests in order, and a verified copy answers what it copied
        # (remote: its sums are the READ's own answer, taken as soon as it landed), so a group
        # that overwrites the last one's destination is ordered after it.
        self.dev = self.client.alloc(cell.slot_bytes) if cell.mode in ("local", "remote") else None
        # FIFO of (g, pendings, cks, expected)
        self.inflight: list[tuple[int, list[Pending], list[Pending], Sequence[int] | None]] = []
        S, K = cell.size, cell.batch
        self._offsets = np.arange(K, dtype=np.uint64) * np.uint64(S)
        self._sizes = np.full(K, S, dtype=np.uint64)
        self._use_many = K > 1 and hasattr(self.client, "copy_many") and hasattr(self.client, "checksum_many")
        #: A verified group is one verified copy_many, whatever its items: the daemon answers
        #: the checksums of what it copied (remote: of what the READ delivered).
        self._verified = cell.mode in ("local", "remote") and hasattr(self.client, "copy_many")
        #: Per slot, its items' (copy destinations, sources) as VA arrays: a producer with
        #: fixed slots computes them once.
        self._vas: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def submit(self, g: int, slot: int, verify: bool, expected: Sequence[int] | None) -> None:
        c = self.client
        vas = self._vas.get(slot) or self._slot_vas(slot)
        check = verify or self.dev is None
        if check and self._verified:  # one verified copy_many
            self.inflight.append((g, [], [c.copy_many(vas[0], vas[1], self._sizes, checksum=True)], expected))
            return
        with c.batch():  # copies unverified, or (compute mode) checksums of the sources in place
            if self._use_many:
                pend = [c.copy_many(vas[0], vas[1], self._sizes)] if self.dev is not None else []
                cks = [c.checksum_many(vas[1], self._sizes)] if check else []
            else:
                S = self.cell.size
                d0, s0 = int(vas[0][0]), int(vas[1][0])
                pend = [c.copy(d0 + i * S, s0 + i * S, S) for i in range(len(vas[0]))] if self.dev is not None else []
                cks = [c.checksum(s0 + i * S, S) for i in range(len(vas[0]))] if check else []
        self.inflight.append((g, pend, cks, expected))

    def _slot_vas(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """A slot's items' (copy destinations, sources): a producer with fixed slots computes
        them once."""
        src0 = self.seg.va + slot * self.cell.slot_bytes
        dst0 = 0 if self.dev is None else self.dev.va
        vas = self._vas[slot] = (np.uint64(dst0) + self._offsets, np.uint64(src0) + self._offsets)
        return vas

    def poll(self, block: bool) -> list[tuple[int, bool]]:
        out: list[tuple[int, bool]] = []
        inflight = self.inflight
        if not block and inflight and not self._all_done(inflight[0]):
            self.client.poll()  # take in whatever replies have arrived, without waiting
        while inflight:
            head = inflight[0]
            if not block and not self._all_done(head):
                break
            g, pend, cks, expected = head
            for p in pend:
                p.result()
            if len(cks) == 1:  # a checksum_many answers an array; a lone checksum an int
                r = cks[0].result()
                got = r.tolist() if isinstance(r, np.ndarray) else [r]
            else:
                got = [p.result() for p in cks]
            ok = expected is None or got == list(expected)
            del inflight[0]
            out.append((g, ok))
            block = False
        return out

    @staticmethod
    def _all_done(entry: tuple[int, list[Pending], list[Pending], Sequence[int] | None]) -> bool:
        for p in entry[1]:
            if not p.done():
                return False
        for p in entry[2]:
            if not p.done():
                return False
        return True

    def bye(self) -> None:
        self.client.fence()

    def close(self) -> None:
        self.buffer = None  # drop our view of the segment before the client unmaps it
        if self.remote and not self.seg.freed:
            # The daemon forgets the segment (and acknowledges) before we deregister it.
            self.client.free(self.seg)
        self.client.close()


class NixlRawProducer(_AckMixin):
    """``nixl-raw`` (remote mode): the batch stays in this process's own memory,
    registered with this process's NIXL agent; the consumer READs it.

    Setup: the agent metadata and the buffer's descriptor list go to the
    consumer over the pipe. Per group: one small header (as ``shm-pipe``),
    an ack back when the consumer has read (and, verified groups, checked) it.
    """

    def __init__(self, cell: Cell, idx: int, spec: Spec) -> None:
        from transfer.transport._nixl import NixlEndpoint

        self.idx = idx
        self.conn = spec["conn"]
        self.ack_conn = self.conn
        self._bye = False
        self.ep = NixlEndpoint(f"{spec['run_id']}-p{idx}-{os.getpid()}", progress="event")
        self.buffer = np.zeros(cell.buffer_bytes, np.uint8)
        self.buffer[:] = 0
        self.reg = self.ep.register(self.buffer)
        # Metadata after registering: it carries the buffer's remote key.
        self.conn.send_bytes(pickle.dumps((idx, self.ep.metadata, self.reg.descs_bytes), protocol=5))

    def submit(self, g: int, slot: int, verify: bool, expected: Sequence[int] | None) -> None:
        self.conn.send_bytes(pack_header(self.idx, g, slot, VERIFY if verify else 0, expected))

    def bye(self) -> None:
        self.conn.send_bytes(pack_header(self.idx, -1, 0, BYE, None))
        self._bye = True

    def close(self) -> None:
        # Deregistration is not revocation (docs/rdma.md): wait until the consumer
        # has dropped us as a peer before the memory goes.
        if self._bye and self.conn.poll(30):
            self.conn.recv_bytes()
        self.ep.close()
        self.conn.close()


PRODUCERS: dict[str, Callable[[Cell, int, Spec], Producer]] = {
    "transfer": TransferProducer,
    "transfer-socket": TransferProducer,
    "zmq-copy": ZmqProducer,
    "zmq-zerocopy": ZmqProducer,
    "mp-queue": QueueProducer,
    "mp-pipe": PipeProducer,
    "shm-pipe": ShmProducer,
    "torch-mp": TorchProducer,
    "iceoryx2": Iceoryx2Producer,
    "nixl-raw": NixlRawProducer,
}


def _slot_items(buf: np.ndarray, cell: Cell) -> list[list[np.ndarray]]:
    S, K = cell.size, cell.batch
    return [[buf[(d * K + i) * S:(d * K + i + 1) * S] for i in range(K)] for d in range(cell.depth)]


# --------------------------------------------------------------------------- consumers
# recv() -> (idx, group, slot, flags, expected, [uint8 views]); ack(idx, group, ok)


class ZmqConsumer:
    def __init__(self, cell: Cell, spec: Spec) -> None:
        import zmq

        self.copy = spec["copy"]
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.bind(spec["data"])
        self.pushes: list[zmq.Socket[bytes]] = []
        for ep in spec["acks"]:
            s = self.ctx.socket(zmq.PUSH)
            s.connect(ep)
            self.pushes.append(s)

    def recv(self) -> Received:
        if self.copy:
            frames = self.pull.recv_multipart(copy=True)
            hdr, items = frames[0], [np.frombuffer(f, np.uint8) for f in frames[1:]]
        else:
            zframes = self.pull.recv_multipart(copy=False)
            hdr, items = zframes[0].bytes, [np.frombuffer(f.buffer, np.uint8) for f in zframes[1:]]
        return (*unpack_header(hdr), items)

    def ack(self, idx: int, g: int, ok: bool) -> None:
        self.pushes[idx].send(ACK.pack(g, ok))

    def close(self) -> None:
        for s in self.pushes:
            s.close(linger=1000)
        self.pull.close(linger=0)
        self.ctx.term()


class QueueConsumer:
    def __init__(self, cell: Cell, spec: Spec) -> None:
        self.q = spec["queue"]
        self.acks = spec["acks"]

    def recv(self) -> Received:
        got: Received = self.q.get()
        return got

    def ack(self, idx: int, g: int, ok: bool) -> None:
        self.acks[idx].send_bytes(ACK.pack(g, ok))

    def close(self) -> None:
        self.q.close()


class PipeConsumer:
    def __init__(self, cell: Cell, spec: Spec) -> None:
        from multiprocessing.connection import wait

        self._wait = wait
        self.conns = list(spec["conns"])
        self.live = list(self.conns)
        self.ready: list[Connection] = []
        self.S = cell.size
        self.staging = np.zeros(cell.slot_bytes, np.uint8)
        self.mv = self.staging.data

    def recv(self) -> Received:
        while not self.ready:
            self.ready = cast("list[Connection]", self._wait(self.live))  # a subset of live
        conn = self.ready.pop(0)
        first = conn.recv_bytes()
        (n,) = struct.unpack_from("<i", first)
        bufs: list[memoryview] = []
        for i in range(n):
            m = self.mv[i * self.S:(i + 1) * self.S]
            conn.recv_bytes_into(m)
            bufs.append(m)
        idx, g, slot, flags, expected, items = pickle.loads(first[4:], buffers=bufs)
        if flags & BYE:
            self.live.remove(conn)
        return idx, g, slot, flags, expected, items

    def ack(self, idx: int, g: int, ok: bool) -> None:
        self.conns[idx].send_bytes(ACK.pack(g, ok))

    def close(self) -> None:
        for c in self.conns:
            c.close()


class TorchConsumer:
    def __init__(self, cell: Cell, spec: Spec) -> None:
        import torch.multiprocessing  # noqa: F401 - rebuilds the producers' shared tensors

        self.cell = cell
        self.q = spec["queue"]
        self.acks = spec["acks"]
        self.tensors: dict[int, Any] = {}
        self.slots: dict[int, list[list[np.ndarray]]] = {}

    def recv(self) -> Received:
        while True:
            msg = self.q.get()
            if isinstance(msg, tuple):  # a producer's shared tensor, once, before its groups
                idx, t = msg
                self.tensors[idx] = t
                self.slots[idx] = _slot_items(t.numpy(), self.cell)
                continue
            idx, g, slot, flags, expected = unpack_header(msg)
            if flags & BYE:
                return idx, g, slot, flags, expected, []
            return idx, g, slot, flags, expected, self.slots[idx][slot]

    def ack(self, idx: int, g: int, ok: bool) -> None:
        self.acks[idx].send_bytes(ACK.pack(g, ok))

    def close(self) -> None:
        self.slots.clear()
        self.tensors.clear()


class ShmConsumer:
    def __init__(self, cell: Cell, spec: Spec) -> None:
        self.cell = cell
        self.notify = spec["notify"]
        self.acks = spec["acks"]
        self.paths = spec["paths"]
        self.maps: dict[int, list[list[np.ndarray]]] = {}

    def _slots(self, idx: int) -> list[list[np.ndarray]]:
        s = self.maps.get(idx)
        if s is None:
            fd = os.open(self.paths[idx], os.O_RDWR)
            try:
                mm = mmap.mmap(fd, self.cell.buffer_bytes)
            finally:
                os.close(fd)
            os.unlink(self.paths[idx])  # both sides hold the mapping; nothing to leak
            s = self.maps[idx] = _slot_items(np.frombuffer(mm, np.uint8), self.cell)
        return s

    def recv(self) -> Received:
        idx, g, slot, flags, expected = unpack_header(self.notify.recv_bytes())
        if flags & BYE:
            return idx, g, slot, flags, expected, []
        return idx, g, slot, flags, expected, self._slots(idx)[slot]

    def ack(self, idx: int, g: int, ok: bool) -> None:
        self.acks[idx].send_bytes(ACK.pack(g, ok))

    def close(self) -> None:
        pass


class NixlRawConsumer:
    """Raw NIXL READ baseline: this process's own agent pulls each group from the
    producer's registered buffer into its registered "device" buffer.

    One READ per group (one descriptor per request), waited, then handed to the
    generic consumer loop (which checksums verified groups, as the daemon does
    for ``transfer``). Remote ranges are computed here from the slot index and
    checked against the producer's registration once, at setup.
    """

    delivers_to_device = True

    def __init__(self, cell: Cell, spec: Spec) -> None:
        from multiprocessing.connection import wait

        from transfer.transport._nixl import NixlEndpoint, check_ranges_within, decode_descs

        self._wait = wait
        self.conns = list(spec["conns"])
        self.live = list(self.conns)
        self.ready: list[Connection] = []
        S, K, D = cell.size, cell.batch, cell.depth
        self.ep = NixlEndpoint(f"{spec['run_id']}-c-{os.getpid()}", progress="none")  # an initiator: as the daemon's agent
        self.dev = np.zeros(cell.slot_bytes, np.uint8)
        self.dev[:] = 0
        self.reg = self.ep.register(self.dev)
        self.items = [self.dev[i * S:(i + 1) * S] for i in range(K)]
        offs = np.arange(K, dtype=np.uint64) * np.uint64(S)
        self.local = np.stack([np.uint64(self.reg.addr) + offs, np.full(K, S, np.uint64)], axis=1)
        self.peers: list[str | None] = [None] * len(self.conns)
        self.slots: list[list[np.ndarray] | None] = [None] * len(self.conns)  # per producer, per slot: (addr, size) rows
        for conn in self.conns:
            if not conn.poll(120):
                raise RuntimeError("nixl-raw: no metadata from a producer within 120 s")
            idx, md, descs = pickle.loads(conn.recv_bytes())
            rd = decode_descs(descs)
            base = np.uint64(int(rd.ranges[0, 0]))
            slots: list[np.ndarray] = []
            for d in range(D):
                rem = np.stack([base + np.uint64(d * cell.slot_bytes) + offs, np.full(K, S, np.uint64)], axis=1)
                check_ranges_within(rd.ranges, rem)
                slots.append(rem)
            name = self.ep.add_peer(md)
            self.ep.connect(name)
            self.peers[idx], self.slots[idx] = name, slots
            self._read(idx, 0)  # wire-up, outside the timed repetitions

    def _read(self, idx: int, slot: int) -> None:
        peer, slots = self.peers[idx], self.slots[idx]
        if peer is None or slots is None:
            raise RuntimeError(f"nixl-raw: producer {idx} sent no metadata")
        x = self.ep.read(peer, self.local, slots[slot])
        try:
            x.wait(60)
        finally:
            x.release()

    def recv(self) -> Received:
        while not self.ready:
            self.ready = cast("list[Connection]", self._wait(self.live))  # a subset of live
        conn = self.ready.pop(0)
        idx, g, slot, flags, expected = unpack_header(conn.recv_bytes())
        if flags & BYE:
            self.live.remove(conn)
            peer = self.peers[idx]
            if peer is not None:
                self.ep.remove_peer(peer)
            conn.send_bytes(ACK.pack(-1, 1))  # the producer may deregister now
            return idx, g, slot, flags, expected, []
        self._read(idx, slot)
        return idx, g, slot, flags, expected, self.items

    def ack(self, idx: int, g: int, ok: bool) -> None:
        self.conns[idx].send_bytes(ACK.pack(g, ok))

    def close(self) -> None:
        self.ep.close()
        for c in self.conns:
            c.close()


CONSUMERS: dict[str, Callable[[Cell, Spec], Consumer]] = {
    "zmq-copy": ZmqConsumer,
    "zmq-zerocopy": ZmqConsumer,
    "mp-queue": QueueConsumer,
    "mp-pipe": PipeConsumer,
    "shm-pipe": ShmConsumer,
    "torch-mp": TorchConsumer,
    "iceoryx2": Iceoryx2Consumer,
    "nixl-raw": NixlRawConsumer,
}
