"""The `iceoryx2` method: iceoryx2's zero-copy publish-subscribe, with events both ways.

A producer loans one sample per group, the generic loop writes the group's items into it
in place, and the header (what `_wire.pack_header` carries for the other methods) rides in
iceoryx2's user header; the consumer copies out of the producer's memory and acks on a
service of its own. Imported only when the method runs (iceoryx2 is an optional extra).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._wire import BYE, VERIFY
from .common import Cell, Received, Spec

__all__ = ["Iceoryx2Producer", "Iceoryx2Consumer", "iox_prefix", "iox_spec", "iox_node", "iox_event"]

#: Longest unix socket path (sun_path less its NUL), and the longest name iceoryx2 puts after
#: the prefix of a listener's socket (a u128 port id and ".event").
_SUN_PATH_MAX = 107
_IOX_SOCKET_TAIL = 39 + len(".event")


def iox_prefix(run_id: str) -> str:
    """iceoryx2's file prefix for a run: unique by the run id's random tail, and short, since
    a listener's unix socket is ``root + prefix + port id`` (see :func:`iox_spec`).
    ``Runner._remove_shm`` sweeps /dev/shm for it too."""
    return f"tbi2-{run_id.rsplit('-', 1)[-1]}-"


def iox_spec(run_dir: str, run_id: str, service: str) -> dict[str, str]:
    """Where iceoryx2 keeps a run's files: ``run_dir`` as its root (removed with it), a file
    prefix of the run's own (so the run's /dev/shm sweep finds whatever a killed process
    left) and the service names' stem (unique, so parallel runs never meet)."""
    root, prefix = run_dir.rstrip("/") + "/", iox_prefix(run_id)
    if len(root) + len(prefix) + _IOX_SOCKET_TAIL > _SUN_PATH_MAX:
        raise RuntimeError(f"iceoryx2: the run directory {run_dir!r} is too long for its unix sockets "
                           f"(set TMPDIR to a shorter path)")
    return {"root": root, "prefix": prefix, "service": f"transfer-bench/{service}"}


def iox_node(spec: Spec) -> Any:
    """One iceoryx2 node per process under the run's private config. Signal handling is off:
    the runner stops a hung worker with SIGTERM, which iceoryx2 would otherwise swallow."""
    import iceoryx2 as iox

    cfg = iox.config.default()
    g = cfg.global_cfg
    g.prefix = iox.FileName.new(spec["prefix"])
    g.root_path = iox.Path.new(spec["root"])
    return (iox.NodeBuilder.new().config(cfg).signal_handling_mode(iox.SignalHandlingMode.Disabled)
            .create(iox.ServiceType.Ipc))


def iox_event(node: Any, name: str, notifiers: int, listeners: int = 1) -> Any:
    """An event service: how an iceoryx2 receiver sleeps until a sender has published."""
    import iceoryx2 as iox

    return (node.service_builder(iox.ServiceName.new(name)).event()
            .max_notifiers(notifiers).max_listeners(listeners).open_or_create())


_IOX_HEADERS: dict[int, type[ctypes.Structure]] = {}


def iox_header_type(k: int) -> type[ctypes.Structure]:
    """The user header of a group's sample: what ``pack_header`` carries for the other methods
    (producer, group, slot, flags, ``k`` expected checksums), as a fixed ctypes struct."""
    t = _IOX_HEADERS.get(k)
    if t is None:
        name = f"transfer_bench::GroupHeader{k}"
        t = _IOX_HEADERS[k] = type(f"GroupHeader{k}", (ctypes.Structure,), {
            "_fields_": [("idx", ctypes.c_int32), ("flags", ctypes.c_int32), ("group", ctypes.c_int64),
                         ("slot", ctypes.c_int32), ("pad", ctypes.c_int32), ("expected", ctypes.c_uint64 * k)],
            "type_name": staticmethod(lambda: name)})
    return t


class IoxAck(ctypes.Structure):
    """A completion (group, ok) on the consumer -> producer publish-subscribe service."""

    _fields_ = [("group", ctypes.c_int64), ("ok", ctypes.c_int64)]

    @staticmethod
    def type_name() -> str:
        return "transfer_bench::Ack"


def _iox_data_service(node: Any, spec: Spec, cell: Cell) -> Any:
    """The groups' publish-subscribe service: one sample (a byte slice) per group.

    Every producer has at most ``depth`` groups in flight and the consumer holds one sample at
    a time, so the queues and the pool are sized to exactly that, with no overflow allowed
    (a lost group would hang the run, never inflate it). No ``payload_alignment``: in 0.10 it
    multiplies a slice's chunk (64-byte alignment made a 1 MiB sample take 64 MiB of the
    pool); the default keeps the items 8-byte aligned, as uint64 views need."""
    import iceoryx2 as iox

    return (node.service_builder(iox.ServiceName.new(spec["service"] + "/data"))
            .publish_subscribe(iox.Slice[ctypes.c_uint8]).user_header(iox_header_type(cell.batch))
            .max_publishers(cell.producers).max_subscribers(1).history_size(0)
            .subscriber_max_buffer_size(cell.depth).subscriber_max_borrowed_samples(1)
            .enable_safe_overflow(False).open_or_create())


def _iox_ack_service(node: Any, spec: Spec, idx: int, cell: Cell) -> Any:
    import iceoryx2 as iox

    return (node.service_builder(iox.ServiceName.new(f"{spec['service']}/ack{idx}"))
            .publish_subscribe(IoxAck).max_publishers(1).max_subscribers(1).history_size(0)
            .subscriber_max_buffer_size(cell.depth + 1).enable_safe_overflow(False).open_or_create())


def _iox_views(ptr: int, cell: Cell) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """uint8 and uint64 views of a group's items in a sample's payload (no copy)."""
    buf = np.ctypeslib.as_array((ctypes.c_uint8 * cell.slot_bytes).from_address(ptr))
    S = cell.size
    items = [buf[i * S:(i + 1) * S] for i in range(cell.batch)]
    return items, [v.view(np.uint64) for v in items]


def _iox_wait(listener: Any) -> None:
    import iceoryx2 as iox

    listener.timed_wait(iox.Duration.from_millis(500))


# --------------------------------------------------------------------------- producers



class Iceoryx2Producer:
    """iceoryx2 as its users publish: each group's items are written in place into a sample
    loaned from the publisher's shared-memory pool (``loan`` is called by the generic loop
    before it writes), the header goes in the sample's user header, ``send`` and an event
    wake the consumer. Acks come back on a publish-subscribe service of this producer's
    own, with an event to sleep on: iceoryx2's event-driven pattern in both directions."""

    def __init__(self, cell: Cell, idx: int, spec: Spec) -> None:
        self.cell = cell
        self.idx = idx
        self.node = iox_node(spec)
        self.data = _iox_data_service(self.node, spec, cell)
        self.pub = self.data.publisher_builder().initial_max_slice_len(cell.slot_bytes).max_loaned_samples(1).create()
        self.data_ev = iox_event(self.node, spec["service"] + "/data-ev", cell.producers)
        self.notifier = self.data_ev.notifier_builder().create()
        self.acks = _iox_ack_service(self.node, spec, idx, cell)
        self.ack_sub = self.acks.subscriber_builder().buffer_size(cell.depth + 1).create()
        self.ack_ev = iox_event(self.node, f"{spec['service']}/ack-ev{idx}", 1)
        self.listener = self.ack_ev.listener_builder().create()
        self.buffer: np.ndarray | None = None  # no fixed buffer: each group goes into a freshly loaned sample
        self.hdr_t = iox_header_type(cell.batch)
        self._loaned: Any = None
        self._views: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}  # payload address -> views
        self._bye_acked = False
        self._bye_sent = False

    def loan(self, slot: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Loan the next group's sample; the loop writes the items into the returned views.
        The pool's chunks are fixed, so their views are built once per address."""
        s = self.pub.loan_slice_uninit(self.cell.slot_bytes)
        self._loaned = s
        v = self._views.get(s.payload_ptr)
        if v is None:
            v = self._views[s.payload_ptr] = _iox_views(s.payload_ptr, self.cell)
        return v

    def _send(self, s: Any, g: int, slot: int, flags: int, expected: Sequence[int] | None) -> None:
        h: Any = self.hdr_t.from_address(s.user_header_ptr)  # its fields are made at run time
        h.idx, h.flags, h.group, h.slot = self.idx, flags, g, slot
        if expected:
            h.expected[:len(expected)] = expected
        s.assume_init().send()
        self.notifier.notify()

    def submit(self, g: int, slot: int, verify: bool, expected: Sequence[int] | None) -> None:
        s, self._loaned = self._loaned, None
        self._send(s, g, slot, VERIFY if verify else 0, expected)

    def poll(self, block: bool) -> list[tuple[int, bool]]:
        out = []
        while True:
            while (s := self.ack_sub.receive()) is not None:
                a = IoxAck.from_address(s.payload_ptr)
                g, ok = a.group, a.ok
                s.delete()
                if g < 0:
                    self._bye_acked = True
                else:
                    out.append((g, bool(ok)))
            if out or not block:
                return out
            _iox_wait(self.listener)

    def bye(self) -> None:
        self._send(self.pub.loan_slice_uninit(0), -1, 0, BYE, None)
        self._bye_sent = True

    def close(self) -> None:
        # A publisher that goes away takes its unread samples with it: the consumer answers the
        # bye (group -1) once it has seen it.
        import time

        deadline = time.monotonic() + 30
        while self._bye_sent and not self._bye_acked and time.monotonic() < deadline:
            self.poll(False)
            if not self._bye_acked:
                _iox_wait(self.listener)
        self._views.clear()
        if self._loaned is not None:
            self._loaned.delete()
        for port in (self.listener, self.ack_sub, self.notifier, self.pub):
            port.delete()
        self.listener = self.ack_sub = self.notifier = self.pub = self._loaned = None
        self.ack_ev = self.acks = self.data_ev = self.data = None
        self.node = None  # the last node of a service removes its shared memory and files



class Iceoryx2Consumer:
    """The subscriber of every producer's groups: it sleeps on the data event, receives a
    sample (zero copy: a view of the producer's pool), and releases it just before the ack,
    after the generic loop has copied (and verified) the items."""

    def __init__(self, cell: Cell, spec: Spec) -> None:
        self.cell = cell
        self.node = iox_node(spec)
        self.data = _iox_data_service(self.node, spec, cell)
        self.sub = self.data.subscriber_builder().buffer_size(cell.depth).create()
        self.data_ev = iox_event(self.node, spec["service"] + "/data-ev", cell.producers)
        self.listener = self.data_ev.listener_builder().create()
        self.acks = [_iox_ack_service(self.node, spec, i, cell) for i in range(cell.producers)]
        self.ack_pubs = [a.publisher_builder().create() for a in self.acks]
        self.ack_evs = [iox_event(self.node, f"{spec['service']}/ack-ev{i}", 1) for i in range(cell.producers)]
        self.notifiers = [e.notifier_builder().create() for e in self.ack_evs]
        self.hdr_t = iox_header_type(cell.batch)
        self._held: Any = None
        self._views: dict[int, list[np.ndarray]] = {}

    def recv(self) -> Received:
        while (s := self.sub.receive()) is None:
            _iox_wait(self.listener)
        h: Any = self.hdr_t.from_address(s.user_header_ptr)  # its fields are made at run time
        idx, g, slot, flags = h.idx, h.group, h.slot, h.flags
        if flags & BYE:
            s.delete()
            self.ack(idx, -1, True)
            return idx, g, slot, flags, None, []
        expected = tuple(h.expected) if flags & VERIFY else None
        self._held = s
        v = self._views.get(s.payload_ptr)
        if v is None:
            v = self._views[s.payload_ptr] = _iox_views(s.payload_ptr, self.cell)[0]
        return idx, g, slot, flags, expected, v

    def ack(self, idx: int, g: int, ok: bool) -> None:
        if self._held is not None:  # the producer may reuse the sample's memory after the ack
            self._held.delete()
            self._held = None
        self.ack_pubs[idx].send_copy(IoxAck(g, int(ok)))
        self.notifiers[idx].notify()

    def close(self) -> None:
        self._views.clear()
        if self._held is not None:
            self._held.delete()
        for port in (*self.notifiers, *self.ack_pubs, self.listener, self.sub):
            port.delete()
        self.notifiers = self.ack_pubs = []
        self.listener = self.sub = self._held = None
        self.ack_evs = self.acks = []
        self.data_ev = self.data = None
        self.node = None
