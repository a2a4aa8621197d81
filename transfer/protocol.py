"""Sans-I/O protocol: typed messages <-> msgpack bytes.

Nothing here opens a socket or knows about an event loop (the h11 model):
callers hand in the bytes of one frame and get typed messages back, or hand
in messages and get bytes. Every field is validated on the way in; anything
that does not fit becomes a :class:`~transfer.errors.ProtocolError`, never
another exception.

Wire format (docs/protocol.md has the full table)::

    request frame:  [VERSION, [[op, id, field...], ...]]
    reply frame:    [VERSION, [[id, 0, result] | [id, code, name, message], ...]]

A reply with id 0 is about the whole frame (it could not be decoded).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence, Union

import msgpack
import numpy as np

from . import errors as E
from .kernels import DTYPES, MAX_DIMS, TensorRef

__all__ = [
    "VERSION",
    "Limits",
    "Request",
    "Hello",
    "Close",
    "Ping",
    "Wait",
    "ComputeRef",
    "Define",
    "RegisterHost",
    "Unregister",
    "Alloc",
    "Free",
    "RegisterRemote",
    "Share",
    "Attach",
    "OpenRing",
    "Copy",
    "CopyV",
    "Fill",
    "Checksum",
    "Compute",
    "TensorRef",
    "Fence",
    "Stats",
    "Reply",
    "BadRequest",
    "encode_requests",
    "decode_requests",
    "encode_replies",
    "decode_replies",
    "frame_error",
    "REQUEST_TYPES",
]

VERSION = 1
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class Limits:
    """Sizes a peer promises to respect; the server announces its own in hello."""

    max_frame_bytes: int = 4 << 20
    max_batch: int = 65536
    max_vector: int = 65536
    max_str: int = 1024
    max_bin: int = 4 << 20

    def to_wire(self) -> dict[str, int]:
        return dataclasses.asdict(self)


DEFAULT_LIMITS = Limits()


# --- field validators: (value) -> value, raising InvalidField ---------------
Validator = Callable[[Any, str], Any]


def _int_range(lo: int, hi: int, kind: str) -> Validator:
    def check(v: Any, name: str) -> int:
        if type(v) is not int:
            raise E.InvalidField(f"{name}: expected {kind}, got {type(v).__name__}")
        if v < lo or v > hi:
            raise E.InvalidField(f"{name}: {v} is outside {kind} range [{lo}, {hi}]")
        return v

    return check


u64 = _int_range(0, U64_MAX, "u64")
u32 = _int_range(0, U32_MAX, "u32")
u8 = _int_range(0, 255, "u8")
i32 = _int_range(I32_MIN, I32_MAX, "i32")


def text(max_len: int) -> Validator:
    def check(v: Any, name: str) -> str:
        if type(v) is not str:
            raise E.InvalidField(f"{name}: expected str, got {type(v).__name__}")
        if len(v) > max_len:
            raise E.InvalidField(f"{name}: longer than {max_len} characters")
        return v

    return check


def blob(max_len: int) -> Validator:
    def check(v: Any, name: str) -> bytes:
        if type(v) is not bytes:
            raise E.InvalidField(f"{name}: expected bytes, got {type(v).__name__}")
        if len(v) > max_len:
            raise E.InvalidField(f"{name}: longer than {max_len} bytes")
        return v

    return check


def u64_vector(v: Any, name: str) -> np.ndarray:
    """A packed little-endian uint64 array (msgpack bin)."""
    if type(v) is not bytes:
        raise E.InvalidField(f"{name}: expected packed uint64 bytes, got {type(v).__name__}")
    if len(v) % 8:
        raise E.InvalidField(f"{name}: length {len(v)} is not a multiple of 8")
    return np.frombuffer(v, dtype="<u8")


MAX_TENSORS = 16
MAX_PARAMS = 32
MAX_PARAM_LIST = 4096


def tensors(v: Any, name: str) -> list[TensorRef]:
    """[[va, dtype, shape, strides|nil], ...]: checked for types and ranges, not yet for memory."""
    if type(v) is not list or len(v) > MAX_TENSORS:
        raise E.InvalidField(f"{name}: expected a list of at most {MAX_TENSORS} tensors")
    out = []
    for k, t in enumerate(v):
        where = f"{name}[{k}]"
        if type(t) is not list or len(t) != 4:
            raise E.InvalidField(f"{where}: a tensor is [va, dtype, shape, strides|nil]")
        va, dtype, shape, strides = t
        u64(va, f"{where}.va")
        if type(dtype) is not str or dtype not in DTYPES:
            raise E.InvalidField(f"{where}.dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
        if type(shape) is not list or len(shape) > MAX_DIMS:
            raise E.InvalidField(f"{where}.shape: expected a list of at most {MAX_DIMS} sizes")
        for d in shape:
            _int_range(0, 1 << 40, "dimension")(d, f"{where}.shape")
        if strides is not None:
            if type(strides) is not list or len(strides) != len(shape):
                raise E.InvalidField(f"{where}.strides: expected nil or one stride per dimension")
            for st_ in strides:
                _int_range(0, 1 << 40, "stride")(st_, f"{where}.strides")
        out.append(TensorRef(va, dtype, tuple(shape), None if strides is None else tuple(strides)))
    return out


def _param_value(v: Any, where: str) -> Any:
    if v is None or type(v) in (bool, int, float):
        if type(v) is int:
            i64_or_u64(v, where)
        return v
    if type(v) is str:
        return text(256)(v, where)
    if type(v) is list:
        if len(v) > MAX_PARAM_LIST:
            raise E.InvalidField(f"{where}: list longer than {MAX_PARAM_LIST}")
        for e in v:
            if type(e) not in (int, float):
                raise E.InvalidField(f"{where}: list elements must be numbers")
        return v
    raise E.InvalidField(f"{where}: unsupported parameter type {type(v).__name__}")


def i64_or_u64(v: int, where: str) -> int:
    if not -(1 << 63) <= v <= U64_MAX:
        raise E.InvalidField(f"{where}: integer out of 64-bit range")
    return v


def params(v: Any, name: str) -> dict[str, Any]:
    if type(v) is not dict or len(v) > MAX_PARAMS:
        raise E.InvalidField(f"{name}: expected a map of at most {MAX_PARAMS} parameters")
    for k, val in v.items():
        if type(k) is not str or len(k) > 64:
            raise E.InvalidField(f"{name}: parameter names are strings of at most 64 characters")
        _param_value(val, f"{name}.{k}")
    return v


def bounded(max_depth: int = 4, max_len: int = 4096) -> Validator:
    """Any msgpack value of limited depth and size; the consumer validates its shape."""

    def walk(v: Any, depth: int, name: str) -> None:
        if depth > max_depth:
            raise E.InvalidField(f"{name}: nested deeper than {max_depth}")
        if v is None or type(v) in (bool, float):
            return
        if type(v) is int:
            i64_or_u64(v, name)
        elif type(v) in (str, bytes):
            if len(v) > max_len:
                raise E.InvalidField(f"{name}: longer than {max_len}")
        elif type(v) is list:
            if len(v) > max_len:
                raise E.InvalidField(f"{name}: more than {max_len} elements")
            for e in v:
                walk(e, depth + 1, name)
        elif type(v) is dict:
            if len(v) > MAX_PARAMS:
                raise E.InvalidField(f"{name}: more than {MAX_PARAMS} entries")
            for k, e in v.items():
                if type(k) is not str:
                    raise E.InvalidField(f"{name}: map keys must be strings")
                walk(e, depth + 1, name)
        else:
            raise E.InvalidField(f"{name}: unsupported type {type(v).__name__}")

    def check(v: Any, name: str) -> Any:
        walk(v, 0, name)
        return v

    return check


def id_versions(v: Any, name: str) -> list[tuple[int, int]]:
    """[[id, version], ...] references to definitions cached by the daemon."""
    if type(v) is not list or len(v) > MAX_TENSORS:
        raise E.InvalidField(f"{name}: expected a list of at most {MAX_TENSORS} [id, version] pairs")
    out = []
    for k, item in enumerate(v):
        if type(item) is not list or len(item) != 2:
            raise E.InvalidField(f"{name}[{k}]: expected [id, version]")
        out.append((u64(item[0], f"{name}[{k}].id"), u32(item[1], f"{name}[{k}].version")))
    return out


#: Define kinds.
DEF_ALLOC, DEF_FREE, DEF_TENSOR, DEF_PLAN = 1, 2, 3, 4


# --- requests ----------------------------------------------------------------
class Request:
    """Base of every request; `id` is chosen by the client and echoed in the reply."""

    __slots__ = ()
    OP: ClassVar[int]
    FIELDS: ClassVar[tuple[tuple[str, Validator], ...]]
    id: int

    def to_wire(self) -> list[Any]:
        return [self.OP, self.id, *(getattr(self, n) for n, _ in self.FIELDS)]


def _request(op: int, *fields: tuple[str, Validator]) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        cls.OP = op
        cls.FIELDS = fields
        return cls

    return wrap


@_request(1, ("version", u32), ("client", text(256)), ("pid", u32), ("token", blob(1024)))
@dataclass(slots=True)
class Hello(Request):
    """Open a session. `pid` lets a same-host daemon notice the client's death at once."""

    id: int
    version: int = VERSION
    client: str = ""
    pid: int = 0
    token: bytes = b""


@_request(2)
@dataclass(slots=True)
class Close(Request):
    """End the session and release everything it owns."""

    id: int


@_request(3)
@dataclass(slots=True)
class Ping(Request):
    """Heartbeat: keeps an idle session alive and proves the daemon is."""

    id: int


@_request(4)
@dataclass(slots=True)
class Wait(Request):
    """Marks a frame whose replies the client blocks on: the daemon counts blocking round trips."""

    id: int


@_request(10, ("nbytes", u64))
@dataclass(slots=True)
class RegisterHost(Request):
    """Create a shared-memory segment both sides map; reply {va, nbytes, path}."""

    id: int
    nbytes: int


@_request(11, ("va", u64))
@dataclass(slots=True)
class Unregister(Request):
    """Release a host segment (by its base VA)."""

    id: int
    va: int


@_request(12, ("nbytes", u64), ("device", i32))
@dataclass(slots=True)
class Alloc(Request):
    """Allocate a device buffer; device -1 lets the daemon choose. Reply {va, nbytes, device}."""

    id: int
    nbytes: int
    device: int = -1


@_request(13, ("va", u64))
@dataclass(slots=True)
class Free(Request):
    """Free a device buffer (by its base VA)."""

    id: int
    va: int


#: NIXL agent metadata and serialized descriptor lists (transfer.transport._nixl) are small.
MAX_NIXL_METADATA = 1 << 20
MAX_NIXL_DESCS = 1 << 16


@_request(14, ("metadata", blob(MAX_NIXL_METADATA)), ("descs", blob(MAX_NIXL_DESCS)), ("nbytes", u64))
@dataclass(slots=True)
class RegisterRemote(Request):
    """Map a producer's NIXL-registered buffer as a `remote` segment; reply {va, nbytes, agent}.

    `metadata` is the producer's NIXL agent metadata (taken after registering),
    `descs` the buffer's descriptor list in the strict `encode_descs` layout (one
    range of exactly `nbytes` bytes). Both are untrusted: the daemon parses them
    strictly and only ever touches the declared range.
    """

    id: int
    metadata: bytes
    descs: bytes
    nbytes: int


@_request(16, ("va", u64))
@dataclass(slots=True)
class Share(Request):
    """Grant other sessions use of a segment or buffer (base VA); reply {token}."""

    id: int
    va: int


@_request(17, ("token", blob(64)))
@dataclass(slots=True)
class Attach(Request):
    """Use a segment another session shared; reply {va, nbytes, kind, device}."""

    id: int
    token: bytes


@_request(18, ("capacity", u32))
@dataclass(slots=True)
class OpenRing(Request):
    """Open this session's shared-memory request ring (same host only; docs/ring.md).

    Reply {path, bell, capacity, completion_capacity}: the client maps the ring
    file and unlinks it, and writes a byte to the daemon's doorbell FIFO `bell`
    when the daemon sleeps. `capacity` is rounded up to a power of two.
    """

    id: int
    capacity: int = 1024


@_request(20, ("dst", u64), ("src", u64), ("nbytes", u64), ("stream", u32))
@dataclass(slots=True)
class Copy(Request):
    id: int
    dst: int
    src: int
    nbytes: int
    stream: int = 0


@_request(21, ("dst", u64_vector), ("src", u64_vector), ("nbytes", u64_vector), ("stream", u32))
@dataclass(slots=True)
class CopyV(Request):
    """Many copies in one request: three packed uint64 arrays of equal length."""

    id: int
    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray
    stream: int = 0

    def to_wire(self) -> list[Any]:
        return [
            self.OP,
            self.id,
            np.ascontiguousarray(self.dst, dtype="<u8").tobytes(),
            np.ascontiguousarray(self.src, dtype="<u8").tobytes(),
            np.ascontiguousarray(self.nbytes, dtype="<u8").tobytes(),
            self.stream,
        ]


@_request(22, ("dst", u64), ("nbytes", u64), ("value", u8), ("stream", u32))
@dataclass(slots=True)
class Fill(Request):
    id: int
    dst: int
    nbytes: int
    value: int = 0
    stream: int = 0


@_request(23, ("src", u64), ("nbytes", u64), ("stream", u32))
@dataclass(slots=True)
class Checksum(Request):
    """Read a range in place and reply with its checksum64."""

    id: int
    src: int
    nbytes: int
    stream: int = 0


@_request(
    24,
    ("op", text(64)),
    ("inputs", tensors),
    ("outputs", tensors),
    ("params", params),
    ("device", i32),
    ("placement", text(32)),
    ("stream", u32),
)
@dataclass(slots=True)
class Compute(Request):
    """Run an operator on tensors named by VA. device -1 and placement "" = the daemon's policy."""

    id: int
    op: str
    inputs: list[TensorRef]
    outputs: list[TensorRef]
    params: dict[str, Any]
    device: int = -1
    placement: str = ""
    stream: int = 0

    def to_wire(self) -> list[Any]:
        return [
            self.OP,
            self.id,
            self.op,
            [t.to_wire() for t in self.inputs],
            [t.to_wire() for t in self.outputs],
            self.params,
            self.device,
            self.placement,
            self.stream,
        ]


@_request(25, ("plan", id_versions), ("inputs", id_versions), ("outputs", id_versions), ("stream", u32))
@dataclass(slots=True)
class ComputeRef(Request):
    """Compute with a cached plan and tensor descriptors, named by client-side id and version."""

    id: int
    plan: list[tuple[int, int]]
    inputs: list[tuple[int, int]]
    outputs: list[tuple[int, int]]
    stream: int = 0

    def to_wire(self) -> list[Any]:
        return [self.OP, self.id, [list(x) for x in self.plan], [list(x) for x in self.inputs], [list(x) for x in self.outputs], self.stream]


@_request(50, ("kind", u8), ("obj", u64), ("version", u32), ("definition", bounded()), ("site", text(256)))
@dataclass(slots=True)
class Define(Request):
    """A deferred creation travelling with its first use: alloc, free, tensor or plan (see DEF_*)."""

    id: int
    kind: int
    obj: int
    version: int
    definition: Any
    site: str = ""


@_request(30, ("stream", u32))
@dataclass(slots=True)
class Fence(Request):
    """Completes once every earlier request of the session on `stream` has."""

    id: int
    stream: int = 0


@_request(40)
@dataclass(slots=True)
class Stats(Request):
    """Counters for this session and the daemon."""

    id: int


REQUEST_TYPES: dict[int, type[Request]] = {
    cls.OP: cls
    for cls in (
        Hello,
        Close,
        Ping,
        Wait,
        RegisterHost,
        Unregister,
        Alloc,
        Free,
        RegisterRemote,
        Share,
        Attach,
        OpenRing,
        Copy,
        CopyV,
        Fill,
        Checksum,
        Compute,
        ComputeRef,
        Define,
        Fence,
        Stats,
    )
}


@dataclass(slots=True)
class BadRequest:
    """A request that could not be decoded; `id` is 0 when even that was unreadable."""

    id: int
    error: E.TransferError


@dataclass(slots=True)
class Reply:
    """The outcome of one request: `error` is None on success."""

    id: int
    result: Any = None
    error: E.TransferError | None = None


Decoded = Union[Request, BadRequest]


# --- framing ------------------------------------------------------------------
def _unpack(data: bytes, limits: Limits) -> Any:
    if len(data) > limits.max_frame_bytes:
        raise E.FrameTooLarge(f"frame of {len(data)} bytes exceeds the limit of {limits.max_frame_bytes}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limits.max_str * 4,
            max_bin_len=limits.max_bin,
            max_array_len=max(limits.max_batch, 16),
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types; all mean "not a frame"
        raise E.MalformedFrame(f"undecodable frame: {type(exc).__name__}: {exc}") from None


def _check_header(obj: Any) -> list[Any]:
    if type(obj) is not list or len(obj) != 2:
        raise E.MalformedFrame("a frame is [version, [message, ...]]")
    version, body = obj
    if type(version) is not int:
        raise E.MalformedFrame("frame version must be an integer")
    if version != VERSION:
        raise E.UnsupportedVersion(f"protocol version {version} is not supported (this side speaks {VERSION})")
    if type(body) is not list:
        raise E.MalformedFrame("frame body must be a list")
    return body


def encode_requests(requests: Sequence[Request]) -> bytes:
    return msgpack.packb([VERSION, [r.to_wire() for r in requests]], use_bin_type=True)


def decode_request(item: Any, limits: Limits = DEFAULT_LIMITS) -> Decoded:
    """One request from its decoded list form; errors become BadRequest."""
    if type(item) is not list or len(item) < 2:
        return BadRequest(0, E.MalformedFrame("a request is [op, id, field...]"))
    op, rid = item[0], item[1]
    if type(rid) is not int or not 0 < rid <= U64_MAX:
        return BadRequest(0, E.MalformedFrame("request id must be an integer in 1..2**64-1"))
    if op == 20 and len(item) == 6:  # Copy, by far the most frequent: checked inline
        _, _, dst, src, nbytes, stream = item
        if (
            type(dst) is int and type(src) is int and type(nbytes) is int and type(stream) is int
            and 0 <= dst <= U64_MAX and 0 <= src <= U64_MAX and 0 <= nbytes <= U64_MAX and 0 <= stream <= U32_MAX
        ):
            return Copy(rid, dst, src, nbytes, stream)
    cls = REQUEST_TYPES.get(op) if type(op) is int else None
    if cls is None:
        return BadRequest(rid, E.UnknownOperation(f"unknown operation {op!r}"))
    fields = cls.FIELDS
    if len(item) != 2 + len(fields):
        return BadRequest(
            rid, E.InvalidField(f"{cls.__name__} takes {len(fields)} fields, got {len(item) - 2}")
        )
    try:
        values = [check(v, f"{cls.__name__}.{name}") for (name, check), v in zip(fields, item[2:])]
        req = cls(rid, *values)
        if isinstance(req, CopyV):
            n = len(req.dst)
            if len(req.src) != n or len(req.nbytes) != n:
                raise E.InvalidField("CopyV: dst, src and nbytes must have the same length")
            if n > limits.max_vector:
                raise E.BatchTooLarge(f"CopyV of {n} copies exceeds the limit of {limits.max_vector}")
    except E.TransferError as exc:
        return BadRequest(rid, exc)
    return req


def decode_requests(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[Decoded]:
    """A request frame -> its requests, each either typed or a BadRequest.

    Raises ProtocolError when the frame as a whole is unusable.
    """
    body = _check_header(_unpack(data, limits))
    if len(body) > limits.max_batch:
        raise E.BatchTooLarge(f"frame carries {len(body)} requests, the limit is {limits.max_batch}")
    return [decode_request(item, limits) for item in body]


def _error_wire(rid: int, err: E.TransferError) -> list[Any]:
    return [rid, err.code, type(err).__name__, err.message]


def encode_replies(replies: Sequence[Reply]) -> bytes:
    body = [
        [r.id, 0, r.result] if r.error is None else _error_wire(r.id, r.error) for r in replies
    ]
    return msgpack.packb([VERSION, body], use_bin_type=True)


def frame_error(err: E.TransferError) -> bytes:
    """The reply to a frame that could not be decoded at all."""
    return encode_replies([Reply(0, error=err)])


def decode_replies(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[Reply]:
    """A reply frame -> replies. The server is checked too: a client must not crash on bad bytes."""
    body = _check_header(_unpack(data, limits))
    out: list[Reply] = []
    for item in body:
        if type(item) is not list or len(item) not in (3, 4) or type(item[0]) is not int:
            raise E.MalformedFrame("a reply is [id, 0, result] or [id, code, name, message]")
        rid, code = item[0], item[1]
        if code == 0 and len(item) == 3:
            out.append(Reply(rid, item[2]))
        elif type(code) is int and code > 0 and len(item) == 4 and type(item[3]) is str:
            out.append(Reply(rid, error=E.error_for_code(code, item[3])))
        else:
            raise E.MalformedFrame("malformed reply status")
    return out
