"""A thin, typed wrapper over NIXL's Python API (UCX backend) for one-sided RDMA.

One :class:`NixlEndpoint` per process owns one NIXL agent. A producer registers
host buffers and sends ``endpoint.metadata`` (plus, per buffer,
``Registration.descs_bytes``) to the server over the control plane; the server
loads the metadata with :meth:`NixlEndpoint.add_peer`, checks every requested
range with :func:`check_ranges_within` against what that peer declared, and
pulls the bytes with :meth:`NixlEndpoint.read` (or pushes with ``write``): one
NIXL transfer for a whole list of ranges.

NIXL is imported lazily: importing this module never needs it. Without it,
creating an endpoint raises :class:`NixlUnavailable`, which names the ``rdma``
extra. See docs/rdma.md for installation, environment and measured figures.

Things this wrapper does on purpose (each is a NIXL pitfall, see docs/rdma.md):

* NIXL's Python API hard-codes the progress-thread delay to 0, so the UCX
  progress thread busy-spins a whole core even when idle. ``progress="event"``
  (the default) sets a 1 ms delay, which makes the thread sleep in ``poll()``
  on the worker's event fd (woken by traffic, 1 ms periodic fallback).
* ``nixl_agent.deserialize_descs`` is ``pickle.loads``: never use it on bytes
  from the wire. :func:`encode_descs` / :func:`decode_descs` use a fixed,
  strictly validated binary layout instead.
* NIXL agent names are chosen by the peer and carried inside its metadata;
  loading metadata whose name is already known *updates* that peer.
  :meth:`NixlEndpoint.add_peer` reads the name first and refuses a clash
  unless told the name to expect.
"""

from __future__ import annotations

import importlib
import logging
import os
import struct
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, Union

import numpy as np

from ..errors import (
    DescriptorFormatError,
    InvalidField,
    NixlError,
    NixlUnavailable,
    NotRegistered,
    PeerDisconnected,
    RemoteRangeError,
    TransferFailed,
    TransferTimeout,
)

__all__ = [
    "NixlUnavailable",
    "NixlError",
    "TransferFailed",
    "PeerDisconnected",
    "NotRegistered",
    "TransferTimeout",
    "RemoteRangeError",
    "DescriptorFormatError",
    "RangeList",
    "RemoteDescs",
    "Registration",
    "Transfer",
    "NixlEndpoint",
    "available",
    "load_nixl",
    "encode_descs",
    "decode_descs",
    "check_ranges_within",
    "peek_agent_name",
]

log = logging.getLogger(__name__)

#: A list of (address, nbytes) pairs, or an (N, 2) integer array of them.
RangeList = Union[Sequence[tuple[int, int]], np.ndarray]

_U64_MAX = (1 << 64) - 1
_U64_NP = np.uint64(_U64_MAX)


# Errors live in transfer.errors (one hierarchy, one code each).


# --------------------------------------------------------------------------- loading
_MODULE_CANDIDATES = ("nixl_cu12", "nixl_cu13", "nixl")
_nixl_mod: ModuleType | None = None
_load_lock = threading.Lock()


def load_nixl() -> ModuleType:
    """Import and return NIXL's Python package, or raise :class:`NixlUnavailable`.

    Tries ``$TRANSFER_NIXL_MODULE`` if set, then ``nixl_cu12``, ``nixl_cu13``
    and the ``nixl`` meta package (last: with a CPU torch installed, the meta
    package imports torch to pick a CUDA flavour, which costs seconds).
    """
    global _nixl_mod
    if _nixl_mod is not None:
        return _nixl_mod
    with _load_lock:
        if _nixl_mod is not None:
            return _nixl_mod
        forced = os.environ.get("TRANSFER_NIXL_MODULE")
        names = (forced,) if forced else _MODULE_CANDIDATES
        errors: list[str] = []
        for name in names:
            try:
                mod = importlib.import_module(name)
                importlib.import_module(f"{mod.__name__}._api")
            except ImportError as exc:  # includes ModuleNotFoundError
                errors.append(f"{name}: {exc}")
                continue
            if not os.environ.get("NIXL_LOG_LEVEL"):
                # NIXL logs INFO lines to *stdout* by default; keep stdout clean.
                logging.getLogger("nixl").setLevel(logging.WARNING)
            _nixl_mod = mod
            return mod
        raise NixlUnavailable(
            "NIXL is not installed (tried " + "; ".join(errors) + "). Install the "
            "'rdma' extra without pulling CUDA torch: "
            "pip install --no-deps 'nixl-cu12>=1.5' (see docs/rdma.md)"
        )


def available() -> bool:
    """True when NIXL can be imported (does not create an agent)."""
    try:
        load_nixl()
    except NixlUnavailable:
        return False
    return True


def _bindings() -> Any:
    return importlib.import_module(f"{load_nixl().__name__}._bindings")


def _api() -> Any:
    return importlib.import_module(f"{load_nixl().__name__}._api")


def _translate(exc: BaseException, what: str) -> NixlError:
    """Map an exception raised by NIXL's bindings to our hierarchy."""
    name = type(exc).__name__
    msg = f"{what}: {name}: {exc}"
    if name == "nixlRemoteDisconnectError":
        return PeerDisconnected(msg)
    if name == "nixlNotFoundError":
        return NotRegistered(msg)
    return NixlError(msg)


# --------------------------------------------------------------------------- ranges
def _as_ranges(ranges: RangeList, what: str) -> np.ndarray:
    """Validate (address, nbytes) pairs; return an (N, 2) uint64 array.

    Every length must be > 0 and ``address + nbytes`` must not overflow 64 bits.
    """
    if isinstance(ranges, np.ndarray):
        arr = ranges
        if arr.ndim != 2 or arr.shape[1] != 2:
            raise InvalidField(f"{what}: expected an (N, 2) array, got shape {arr.shape}")
        if arr.dtype.kind not in "iu":
            raise InvalidField(f"{what}: expected an integer array, got {arr.dtype}")
        if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
            raise InvalidField(f"{what}: negative address or length")
        arr = arr.astype(np.uint64, copy=False)
    else:
        try:
            pairs = [(int(a), int(n)) for a, n in ranges]
        except (TypeError, ValueError) as exc:
            raise InvalidField(f"{what}: expected (address, nbytes) pairs: {exc}") from None
        for a, n in pairs:
            if a < 0 or n < 0 or a > _U64_MAX or n > _U64_MAX:
                raise InvalidField(f"{what}: address or length out of 64-bit range: ({a}, {n})")
        arr = np.array(pairs, dtype=np.uint64).reshape(-1, 2)
    if arr.shape[0] == 0:
        return arr
    addr, nbytes = arr[:, 0], arr[:, 1]
    # One scan for both faults, then the precise one.
    if not ((nbytes == 0) | (addr > _U64_NP - nbytes)).any():
        return arr
    zero = np.flatnonzero(nbytes == 0)
    if zero.size:
        raise InvalidField(f"{what}: range {int(zero[0])} has length 0")
    over = np.flatnonzero(addr > _U64_NP - nbytes)
    if over.size:
        i = int(over[0])
        raise InvalidField(f"{what}: range {i} ({int(addr[i])}, {int(nbytes[i])}) overflows 64 bits")
    return arr


def check_ranges_within(registered: RangeList, requested: RangeList) -> None:
    """Raise :class:`RemoteRangeError` unless every requested range lies inside
    ONE registered range (touching two adjacent registrations is refused, as
    NIXL needs one remote key per descriptor). Pure; O((N + M) log M).

    Both arguments are lists of (address, nbytes) or (N, 2) integer arrays.
    Zero-length, negative and overflowing ranges raise :class:`InvalidField`.
    """
    reg = _as_ranges(registered, "registered")
    req = _as_ranges(requested, "requested")
    if req.shape[0] == 0:
        return
    if reg.shape[0] == 0:
        raise RemoteRangeError("requested range 0 lies outside every registered range (none registered)")
    order = np.argsort(reg[:, 0], kind="stable")
    starts = reg[order, 0]
    ends = reg[order, 0] + reg[order, 1]  # no overflow: checked by _as_ranges
    # Among registrations starting at or before an address, the one reaching
    # furthest is the only candidate that needs checking.
    reach = np.maximum.accumulate(ends)
    r_start = req[:, 0]
    r_end = req[:, 0] + req[:, 1]
    idx = np.searchsorted(starts, r_start, side="right").astype(np.int64) - 1
    ok = idx >= 0
    ok[ok] &= reach[idx[ok]] >= r_end[ok]
    bad = np.flatnonzero(~ok)
    if bad.size:
        i = int(bad[0])
        raise RemoteRangeError(
            f"requested range {i} (0x{int(r_start[i]):x}, {int(req[i, 1])} bytes) lies outside every "
            f"registered range ({bad.size} of {req.shape[0]} ranges refused)"
        )


# --------------------------------------------------------------------------- descriptor wire format
_MEM_TYPES = {"DRAM": 0, "VRAM": 1}
_MEM_NAMES = {v: k for k, v in _MEM_TYPES.items()}
_DESC_MAGIC = b"TXND"
_DESC_VERSION = 1
_DESC_HEADER = struct.Struct("<4sBBHII")  # magic, version, mem type, reserved, dev id, count
MAX_WIRE_DESCS = 1 << 20


@dataclass(frozen=True)
class RemoteDescs:
    """A decoded descriptor list: memory kind, device id and (N, 2) uint64 ranges."""

    mem_type: Literal["DRAM", "VRAM"]
    dev_id: int
    ranges: np.ndarray = field(repr=False)

    def __len__(self) -> int:
        return int(self.ranges.shape[0])


def encode_descs(ranges: RangeList, mem_type: str = "DRAM", dev_id: int = 0) -> bytes:
    """Serialize (address, nbytes) ranges to the fixed layout :func:`decode_descs` reads.

    Layout (little endian): ``b"TXND"``, u8 version (1), u8 mem type (0 DRAM,
    1 VRAM), u16 reserved (0), u32 device id, u32 count, then count x (u64
    address, u64 nbytes). Not pickle: safe to parse from untrusted peers.
    """
    if mem_type not in _MEM_TYPES:
        raise InvalidField(f"mem_type must be one of {sorted(_MEM_TYPES)}, got {mem_type!r}")
    if not 0 <= dev_id <= 0xFFFFFFFF:
        raise InvalidField(f"dev_id out of range: {dev_id}")
    arr = _as_ranges(ranges, "ranges")
    if arr.shape[0] > MAX_WIRE_DESCS:
        raise InvalidField(f"too many descriptors: {arr.shape[0]} > {MAX_WIRE_DESCS}")
    head = _DESC_HEADER.pack(_DESC_MAGIC, _DESC_VERSION, _MEM_TYPES[mem_type], 0, dev_id, arr.shape[0])
    return head + arr.astype("<u8", copy=False).tobytes()


def decode_descs(data: bytes | bytearray | memoryview, *, max_count: int = MAX_WIRE_DESCS) -> RemoteDescs:
    """Parse bytes from :func:`encode_descs`, from an untrusted peer.

    Checks magic, version, memory type, reserved bits, exact length, count
    limit, non-zero lengths and 64-bit overflow; raises
    :class:`DescriptorFormatError` (or :class:`InvalidField`) otherwise.
    """
    buf = memoryview(data).cast("B")
    if len(buf) < _DESC_HEADER.size:
        raise DescriptorFormatError(f"descriptor list too short: {len(buf)} bytes")
    magic, version, mem, reserved, dev_id, count = _DESC_HEADER.unpack_from(buf, 0)
    if magic != _DESC_MAGIC:
        raise DescriptorFormatError(f"bad descriptor magic {bytes(magic)!r}")
    if version != _DESC_VERSION:
        raise DescriptorFormatError(f"unsupported descriptor version {version}")
    if mem not in _MEM_NAMES:
        raise DescriptorFormatError(f"unknown memory type {mem}")
    if reserved != 0:
        raise DescriptorFormatError("reserved header bits set")
    if count > max_count:
        raise DescriptorFormatError(f"too many descriptors: {count} > {max_count}")
    expected = _DESC_HEADER.size + 16 * count
    if len(buf) != expected:
        raise DescriptorFormatError(f"descriptor list is {len(buf)} bytes, expected {expected} for {count}")
    arr = np.frombuffer(buf, dtype="<u8", count=2 * count, offset=_DESC_HEADER.size).reshape(count, 2)
    arr = arr.astype(np.uint64)  # own copy, native order
    try:
        arr = _as_ranges(arr, "descriptor list")
    except InvalidField as exc:
        raise DescriptorFormatError(str(exc)) from None
    return RemoteDescs(_MEM_NAMES[mem], int(dev_id), arr)  # type: ignore[arg-type]


_MD_PREFIX = b"nixlSerDes|Agent"


def peek_agent_name(metadata: bytes | bytearray | memoryview, *, max_len: int = 256) -> str:
    """Read the agent name from NIXL agent metadata without loading it.

    NIXL's serialized metadata begins ``b"nixlSerDes|Agent"``, a u64 length and
    the name; anything else raises :class:`DescriptorFormatError`.
    """
    buf = bytes(memoryview(metadata)[: len(_MD_PREFIX) + 8 + max_len])
    if not buf.startswith(_MD_PREFIX) or len(buf) < len(_MD_PREFIX) + 8:
        raise DescriptorFormatError("not NIXL agent metadata")
    (n,) = struct.unpack_from("<Q", buf, len(_MD_PREFIX))
    start = len(_MD_PREFIX) + 8
    if not 0 < n <= max_len or len(buf) < start + n:
        raise DescriptorFormatError(f"bad agent name length {n}")
    try:
        return buf[start : start + n].decode("utf-8")
    except UnicodeDecodeError:
        raise DescriptorFormatError("agent name is not UTF-8") from None


# --------------------------------------------------------------------------- registration / transfer
@dataclass(eq=False)
class Registration:
    """One registered contiguous host (or device) region."""

    addr: int
    nbytes: int
    mem_type: str
    dev_id: int
    _reg_descs: Any = field(repr=False)
    _owner: Any = field(repr=False)  # keeps the buffer alive while registered
    registered: bool = True

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(self.addr, self.nbytes)]

    @property
    def descs_bytes(self) -> bytes:
        """The whole region as a serialized descriptor list (see :func:`encode_descs`)."""
        return encode_descs(self.ranges, self.mem_type, self.dev_id)

    def contains(self, addr: int, nbytes: int) -> bool:
        return nbytes > 0 and self.addr <= addr and addr + nbytes <= self.addr + self.nbytes


class Transfer:
    """One posted NIXL transfer (many descriptors). Poll, wait, then release.

    ``poll()`` never blocks and suits an event loop (call it between
    ``trio.sleep``s); ``wait()`` blocks with a short spin then sleeps.
    Usable as a context manager (releases on exit).
    """

    __slots__ = ("_ep", "_handle", "op", "peer", "nbytes", "count", "_state", "_error", "posted_at", "_prepared", "__weakref__")

    def __init__(self, ep: "NixlEndpoint", handle: Any, op: str, peer: str, nbytes: int, count: int,
                 prepared: "Prepared | None" = None) -> None:
        self._ep = ep
        self._handle = handle
        #: The `Prepared` whose NIXL request this posting is: done, it keeps the request.
        self._prepared = prepared
        self.op = op
        self.peer = peer
        self.nbytes = nbytes
        self.count = count
        self._state = "PROC"
        self._error: NixlError | None = None
        self.posted_at = time.perf_counter()

    def __repr__(self) -> str:
        return f"Transfer({self.op} {self.count} descs, {self.nbytes} B, peer={self.peer!r}, state={self._state})"

    @property
    def done(self) -> bool:
        return self._state == "DONE"

    def _fail(self, err: NixlError) -> NixlError:
        self._state = "ERR"
        self._error = err
        return err

    def poll(self) -> bool:
        """True when complete; False while in flight; raises if it failed."""
        if self._state == "DONE":
            return True
        if self._state == "ERR":
            assert self._error is not None
            raise self._error
        if self._handle is None:
            raise NixlError("transfer was released before completion")
        try:
            state = self._ep._agent.check_xfer_state(self._handle)
        except Exception as exc:
            raise self._fail(_translate(exc, f"{self.op} from {self.peer!r}")) from exc
        if state == "DONE":
            self._state = "DONE"
            return True
        if state == "PROC":
            return False
        raise self._fail(
            TransferFailed(f"{self.op} of {self.nbytes} bytes with peer {self.peer!r} failed (NIXL state {state})")
        )

    def wait(self, timeout: float | None = 10.0, *, spin: float = 50e-6) -> None:
        """Block until done; raise :class:`TransferFailed` or :class:`TransferTimeout`.

        Busy-polls for ``spin`` seconds, then sleeps with backoff up to 1 ms.
        ``timeout=None`` waits forever (peer death is still reported: UCX's
        error handling fails the transfer when the connection breaks).
        """
        if self.poll():
            return
        start = time.perf_counter()
        deadline = None if timeout is None else start + timeout
        delay = 0.0
        while True:
            if self.poll():
                return
            now = time.perf_counter()
            if deadline is not None and now >= deadline:
                raise TransferTimeout(
                    f"{self.op} of {self.nbytes} bytes with peer {self.peer!r} not done after {timeout:.3f} s"
                )
            if now - start > spin:
                delay = min(1e-3, max(20e-6, delay * 2))
                time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - now)))

    def release(self) -> None:
        """Free the handle. An in-flight transfer is aborted if the backend can;
        if it cannot, :class:`NixlError` is raised and the handle is kept."""
        h = self._handle
        if h is None:
            return
        prepared = self._prepared
        if prepared is not None:
            prepared.busy = False
            if self._state == "DONE":  # the request stays with its `Prepared`, for the next post
                self._handle = None
                self._ep._transfers.discard(self)
                return
            prepared.handle = None  # failed or in flight: released (aborted) here; the next post makes one
        try:
            h.release()
        except Exception as exc:
            raise _translate(exc, "releasing transfer") from exc
        self._handle = None
        self._ep._transfers.discard(self)

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.release()
        except NixlError:
            if exc[0] is None:
                raise
            log.warning("could not release %r while unwinding", self)


class Prepared:
    """One transfer's descriptor lists, to post again and again (`NixlEndpoint.post_prepared`).

    NIXL makes a request from two descriptor lists once (`initialize_xfer`: the lists, their
    checks against the registrations, the request), and a request that is done may be
    posted again. A producer's fixed slots repeat their transfers, so reposting skips that
    work and the release after each post: ~6 us of the daemon's thread per request. The
    request is made at the first post and released with this object (or when a posting of
    it fails, the next post making a new one); one posting at a time (`busy`)."""

    __slots__ = ("op", "peer", "local", "remote", "local_mem", "handle", "busy")

    def __init__(self, op: str, peer: str, local: np.ndarray, remote: np.ndarray, local_mem: str = "DRAM") -> None:
        self.op, self.peer, self.local, self.remote, self.local_mem = op, peer, local, remote, local_mem
        self.handle: Any = None
        self.busy = False


# --------------------------------------------------------------------------- endpoint
ProgressMode = Literal["event", "spin", "none"]
_cfg_patch_lock = threading.Lock()


def _make_agent(name: str, backends: Sequence[str], progress: ProgressMode, progress_delay_us: int, sync: str) -> Any:
    api = _api()
    b = _bindings()
    sync_modes = {
        "none": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        "strict": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        "rw": api.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
    }
    conf = api.nixl_agent_config(
        enable_prog_thread=progress != "none",
        enable_listen_thread=False,
        backends=list(backends),
        sync_mode=sync_modes[sync],
    )
    if progress != "event":
        return api.nixl_agent(name, conf)

    # nixl_agent.__init__ hard-codes ``pthrDelay = 0`` (a busy-spinning progress
    # thread). Swap in a config class that clamps the delay up while it builds.
    base = b.nixlAgentConfig
    prop = base.pthrDelay

    class _EventConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 (NIXL's name)
            delay: int = prop.__get__(self)
            return delay

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            prop.__set__(self, max(int(value), progress_delay_us))

    with _cfg_patch_lock:
        b.nixlAgentConfig = _EventConfig
        try:
            return api.nixl_agent(name, conf)
        finally:
            b.nixlAgentConfig = base


class NixlEndpoint:
    """One NIXL agent (UCX backend) for this process.

    Args:
        name: agent name, unique among the peers that will load our metadata.
        progress: ``"event"`` (default: UCX progress thread sleeping on the
            worker's event fd, ~0 CPU idle), ``"spin"`` (NIXL's own default: a
            core busy-polling, lowest latency) or ``"none"`` (no thread; the
            worker progresses only inside our calls such as ``Transfer.poll``
            or ``get_notifs``, so a pure *target* must call those for peers'
            one-sided operations over tcp to make progress).
        sync: NIXL thread-safety mode: ``"strict"`` (default, safe from any
            thread), ``"rw"`` or ``"none"`` (single-threaded use only).
    """

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        progress: ProgressMode = "event",
        progress_delay_us: int = 1000,
        sync: Literal["strict", "rw", "none"] = "strict",
    ) -> None:
        if not name or len(name.encode()) > 256:
            raise InvalidField("agent name must be 1..256 bytes")
        if progress not in ("event", "spin", "none"):
            raise InvalidField(f"progress must be 'event', 'spin' or 'none', got {progress!r}")
        load_nixl()
        self.name = name
        try:
            self._agent = _make_agent(name, backends, progress, progress_delay_us, sync)
        except NixlUnavailable:
            raise
        except Exception as exc:
            tls = os.environ.get("UCX_TLS")
            hint = (
                f" UCX_TLS={tls!r}: UCX needs a wire-up transport (tcp) besides shared memory; "
                "unset UCX_TLS or include tcp (e.g. UCX_TLS=tcp,sm,cma,self). An empty UCX_TLS also fails."
                if tls is not None
                else ""
            )
            raise NixlError(f"creating NIXL agent {name!r} failed: {type(exc).__name__}: {exc}.{hint}") from exc
        missing = [bk for bk in backends if bk not in self._agent.backends]
        if missing:
            raise NixlError(f"NIXL backend(s) {missing} unavailable; plugins: {self._agent.get_plugin_list()}")
        self._regs: dict[int, Registration] = {}
        self._peers: set[str] = set()
        self._transfers: weakref.WeakSet[Transfer] = weakref.WeakSet()
        self._closed = False
        b = _bindings()
        self._dram, self._vram = b.DRAM_SEG, b.VRAM_SEG
        self._xfer_dlist = b.nixlXferDList

    # -- metadata / peers ------------------------------------------------------------
    @property
    def metadata(self) -> bytes:
        """Our full agent metadata (connection info + every current registration).

        Send it to a peer *after* registering the buffers it will access: a
        peer only knows the registrations present in the metadata it loaded
        (send it again, or :meth:`registration_metadata`, after new ones)."""
        self._check_open()
        return bytes(self._agent.get_agent_metadata())

    def registration_metadata(self, regs: Iterable[Registration], *, include_conn: bool = False) -> bytes:
        """Partial metadata carrying only ``regs`` (for a peer that already has us)."""
        self._check_open()
        regs = list(regs)
        if not regs:
            raise InvalidField("no registrations given")
        dl = _bindings().nixlRegDList(self._dram, [(r.addr, r.nbytes, r.dev_id, "") for r in regs])
        try:
            return bytes(self._agent.get_partial_agent_metadata(dl, include_conn, ["UCX"]))
        except Exception as exc:
            raise _translate(exc, "building partial metadata") from exc

    def add_peer(self, metadata: bytes, *, expected_name: str | None = None, allow_update: bool = False) -> str:
        """Load a peer's metadata; return its agent name.

        The name comes from the peer. If ``expected_name`` is given it must
        match; otherwise a name already loaded is refused unless
        ``allow_update`` (an update merges, so a peer could overwrite another
        peer's metadata by reusing its name). Our own name is always refused.
        """
        self._check_open()
        name = peek_agent_name(metadata)
        if expected_name is not None and name != expected_name:
            raise NixlError(f"peer metadata names agent {name!r}, expected {expected_name!r}")
        if name == self.name:
            raise NixlError(f"peer metadata uses our own agent name {name!r}")
        if name in self._peers and not allow_update and expected_name is None:
            raise NixlError(f"peer {name!r} is already loaded (pass allow_update=True to update it)")
        try:
            loaded = self._agent.add_remote_agent(bytes(metadata))
        except Exception as exc:
            raise _translate(exc, "loading peer metadata") from exc
        loaded = loaded.decode() if isinstance(loaded, (bytes, bytearray)) else str(loaded)
        self._peers.add(loaded)
        return loaded

    def connect(self, peer: str) -> None:
        """Establish the UCX connection now (else the first transfer does it)."""
        self._check_open()
        try:
            self._agent.make_connection(peer)
        except Exception as exc:
            raise _translate(exc, f"connecting to {peer!r}") from exc

    def remove_peer(self, name: str) -> None:
        """Forget a peer and disconnect from it. Unknown names are ignored."""
        self._check_open()
        if name not in self._peers:
            return
        self._peers.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            raise _translate(exc, f"removing peer {name!r}") from exc

    @property
    def peers(self) -> frozenset[str]:
        return frozenset(self._peers)

    # -- memory ---------------------------------------------------------------------
    def register(self, buffer: Any) -> Registration:
        """Register a writable, C-contiguous host buffer (NumPy array, mmap,
        bytearray, memoryview) for DRAM transfers. The buffer is kept alive
        until :meth:`deregister`."""
        self._check_open()
        if isinstance(buffer, np.ndarray):
            arr = buffer
            if not arr.flags.c_contiguous:
                raise InvalidField("array must be C-contiguous")
        else:
            try:
                arr = np.frombuffer(buffer, dtype=np.uint8)
            except (TypeError, ValueError) as exc:
                raise InvalidField(f"cannot take the address of {type(buffer).__name__}: {exc}") from None
        if not arr.flags.writeable:
            raise InvalidField("buffer is read-only; peers may WRITE into registered memory")
        if arr.nbytes == 0:
            raise InvalidField("cannot register an empty buffer")
        return self.register_address(int(arr.ctypes.data), int(arr.nbytes), owner=buffer)

    def register_address(self, addr: int, nbytes: int, *, owner: Any = None, mem: Literal["DRAM", "VRAM"] = "DRAM",
                         dev_id: int = 0) -> Registration:
        """Register raw memory ``[addr, addr + nbytes)`` (the caller keeps it mapped): host
        memory (DRAM), or a GPU's (VRAM, on CUDA device `dev_id`: a peer's READ or WRITE
        lands in it directly, GPUDirect RDMA where the NIC allows)."""
        self._check_open()
        _as_ranges([(addr, nbytes)], "registration")
        if mem not in _MEM_TYPES:
            raise InvalidField(f"memory type must be DRAM or VRAM, got {mem!r}")
        try:
            descs = self._agent.register_memory([(addr, nbytes, dev_id, "")], mem)
        except Exception as exc:
            raise _translate(exc, f"registering {nbytes} bytes of {mem} at 0x{addr:x}") from exc
        reg = Registration(addr, nbytes, mem, dev_id, descs, owner)
        self._regs[id(reg)] = reg
        return reg

    def deregister(self, reg: Registration) -> None:
        """Deregister. Peers holding our old metadata can no longer access it."""
        self._check_open()
        if not reg.registered:
            return
        try:
            self._agent.deregister_memory(reg._reg_descs)
        except Exception as exc:
            raise _translate(exc, f"deregistering 0x{reg.addr:x}") from exc
        reg.registered = False
        reg._owner = None
        self._regs.pop(id(reg), None)

    @property
    def registrations(self) -> list[Registration]:
        return list(self._regs.values())

    # -- transfers ------------------------------------------------------------------
    def _dlist(self, ranges: np.ndarray, mem: str = "DRAM") -> Any:
        seg = self._dram if mem == "DRAM" else self._vram
        if ranges.shape[1] == 3:  # already NIXL's rows: (address, nbytes, device id)
            return self._xfer_dlist(seg, ranges)
        rows = np.zeros((ranges.shape[0], 3), dtype=np.uint64)
        rows[:, :2] = ranges
        return self._xfer_dlist(seg, rows)

    def _post(self, op: str, peer: str, local: RangeList, remote: RangeList, notif: bytes, checked: bool,
              nbytes: int | None = None, local_mem: str = "DRAM") -> Transfer:
        self._check_open()
        if peer not in self._peers:
            raise NixlError(f"unknown peer {peer!r}: add_peer() its metadata first")
        if checked:  # the caller's own uint64 rows, (N, 2) or NIXL's (N, 3): non-empty, lengths equal and > 0
            loc, rem = local, remote
            assert isinstance(loc, np.ndarray) and isinstance(rem, np.ndarray)
        else:
            loc = _as_ranges(local, "local ranges")
            rem = _as_ranges(remote, "remote ranges")
            if loc.shape[0] != rem.shape[0]:
                raise InvalidField(f"{loc.shape[0]} local ranges but {rem.shape[0]} remote ranges")
            if loc.shape[0] == 0:
                raise InvalidField("empty transfer")
            unequal = loc[:, 1] != rem[:, 1]
            if unequal.any():
                i = int(unequal.argmax())
                raise InvalidField(f"range {i}: local length {int(loc[i, 1])} != remote length {int(rem[i, 1])}")
        handle = self._request(op, peer, loc, rem, notif, local_mem)
        if nbytes is None:
            nbytes = int(loc[:, 1].sum(dtype=np.uint64))
        return self._launch(Transfer(self, handle, op, peer, nbytes, int(loc.shape[0])))

    def _request(self, op: str, peer: str, loc: np.ndarray, rem: np.ndarray, notif: bytes, local_mem: str = "DRAM") -> Any:
        try:
            return self._agent.initialize_xfer(op, self._dlist(loc, local_mem), self._dlist(rem), peer, bytes(notif))
        except Exception as exc:
            raise _translate(
                exc,
                f"preparing {op} of {loc.shape[0]} ranges with {peer!r} (a NOT_FOUND here means a range "
                "is outside our registrations or the peer's metadata)",
            ) from exc

    def prepare(self, op: str, peer: str, local: np.ndarray, remote: np.ndarray, local_mem: str = "DRAM") -> Prepared:
        """A transfer to post again and again (`post_prepared`): rows as `read(checked=True)`
        takes them (the caller validated them); nothing is asked of NIXL until the first post."""
        if op not in ("READ", "WRITE"):
            raise InvalidField(f"op must be READ or WRITE, got {op!r}")
        return Prepared(op, peer, local, remote, local_mem)

    def post_prepared(self, prepared: Prepared, nbytes: int) -> Transfer:
        """Post a `Prepared` transfer (`nbytes` in all), as `read`/`write` would post its lists."""
        self._check_open()
        if prepared.peer not in self._peers:
            raise NixlError(f"unknown peer {prepared.peer!r}: add_peer() its metadata first")
        if prepared.busy:
            raise NixlError("a prepared transfer is posted once at a time (the last posting is not released)")
        if prepared.handle is None:
            prepared.handle = self._request(prepared.op, prepared.peer, prepared.local, prepared.remote, b"", prepared.local_mem)
        prepared.busy = True
        return self._launch(Transfer(self, prepared.handle, prepared.op, prepared.peer, nbytes, int(prepared.local.shape[0]), prepared))

    def _launch(self, xfer: Transfer) -> Transfer:
        """Post a transfer's request: done (a same-host post copies in place) or in flight."""
        op, peer, handle = xfer.op, xfer.peer, xfer._handle
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            err = _translate(exc, f"posting {op} to {peer!r}")
            self._release_quietly(xfer)
            raise err from exc
        if state == "DONE":
            xfer._state = "DONE"
        elif state != "PROC":
            self._release_quietly(xfer)
            raise TransferFailed(f"posting {op} of {xfer.nbytes} bytes to {peer!r} failed (NIXL state {state})")
        self._transfers.add(xfer)
        return xfer

    @staticmethod
    def _release_quietly(xfer: Transfer) -> None:
        try:
            xfer.release()
        except NixlError:
            log.warning("could not release failed %r", xfer)

    def read(self, peer: str, local: RangeList, remote: RangeList, *, notif: bytes = b"", checked: bool = False,
             nbytes: int | None = None, local_mem: str = "DRAM") -> Transfer:
        """One-sided READ: copy each ``remote[i]`` of ``peer`` into ``local[i]``.

        ``local`` must lie in our registrations, ``remote`` in the peer's (as
        of the metadata we loaded); pair lengths must match. One NIXL transfer
        is posted for the whole list; ``notif`` is delivered to the peer when
        it completes. Check untrusted ``remote`` ranges with
        :func:`check_ranges_within` first: NIXL accepts any range inside any
        of the peer's registrations. ``checked``: the caller has validated both
        lists already, as (N, 2) uint64 arrays of equal, non-zero lengths that
        do not wrap, or as NIXL's own (N, 3) rows (address, nbytes, device id)
        (the daemon's planner, which checked them against its mapping table),
        so they are not validated again; ``nbytes``, their total if known; ``local_mem``,
        the memory type of our ranges (VRAM: registered GPU memory).
        """
        return self._post("READ", peer, local, remote, notif, checked, nbytes, local_mem)

    def write(self, peer: str, local: RangeList, remote: RangeList, *, notif: bytes = b"", checked: bool = False,
              nbytes: int | None = None, local_mem: str = "DRAM") -> Transfer:
        """One-sided WRITE: copy each ``local[i]`` into ``remote[i]`` of ``peer`` (``checked``, ``nbytes``,
        ``local_mem``: as for read)."""
        return self._post("WRITE", peer, local, remote, notif, checked, nbytes, local_mem)

    # -- notifications --------------------------------------------------------------
    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications, by peer name (also progresses the worker)."""
        self._check_open()
        try:
            raw = self._agent.get_new_notifs()
        except Exception as exc:
            raise _translate(exc, "reading notifications") from exc
        return {(k.decode() if isinstance(k, bytes) else k): list(v) for k, v in raw.items()}

    def send_notif(self, peer: str, message: bytes) -> None:
        self._check_open()
        try:
            self._agent.send_notif(peer, message)
        except Exception as exc:
            raise _translate(exc, f"notifying {peer!r}") from exc

    # -- lifetime -------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise NixlError("endpoint is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release transfers, deregister memory, drop peers, destroy the agent."""
        if self._closed:
            return
        for xfer in list(self._transfers):
            try:
                xfer.release()
            except NixlError as exc:
                log.warning("close: %s", exc)
        for reg in list(self._regs.values()):
            try:
                self.deregister(reg)
            except NixlError as exc:
                log.warning("close: %s", exc)
        for peer in list(self._peers):
            try:
                self.remove_peer(peer)
            except NixlError as exc:
                log.warning("close: %s", exc)
        self._closed = True
        self._agent = None  # the C++ agent (and its progress thread) goes with the last reference

    def __enter__(self) -> "NixlEndpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._regs)} regs, {len(self._peers)} peers"
        return f"NixlEndpoint({self.name!r}, {state})"
