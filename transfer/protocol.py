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

The codec is msgspec: requests are ``array_like`` Structs tagged with their op,
so one typed decoder turns a whole frame into messages in C, checking types
and ranges (``Meta`` bounds) as it goes. What a type cannot say (equal vector
lengths, tensor rules, parameter maps, per-connection limits) is checked after
decoding, per request. Only when the typed decode fails does a frame take the
slow path: its requests are decoded one by one, so a bad request becomes a
:class:`BadRequest` of its own and never poisons its neighbours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Union, cast

import msgspec
import numpy as np
from msgspec import UNSET, Meta, Raw, UnsetType

from . import _results as R
from . import errors as E
from ._fields import (  # noqa: F401 - the wire's field types, validators and limits, named here too
    I32,
    I32_MAX,
    I32_MIN,
    MAX_NIXL_DESCS,
    MAX_NIXL_METADATA,
    MAX_PARAM_LIST,
    MAX_PARAMS,
    MAX_TENSORS,
    U8,
    U32,
    U32_MAX,
    U64,
    U64_MAX,
    PID_MAX,
    Pid,
    Bin64,
    Bin1024,
    IdVersions,
    NixlDescs,
    NixlMetadata,
    RequestId,
    Str32,
    Str64,
    Str256,
    Validator,
    bounded,
    check_result,
    i32,
    i64_or_u64,
    params,
    tensors,
    text,
    u8,
    u32,
    u64,
)
from ._native import ints_within as _native_ints_within
from .kernels import MAX_GRAPH_NODES, MAX_GRAPH_TENSORS, TensorRef  # noqa: F401 - graph limits are the protocol's

__all__ = [
    "VERSION",
    "PRIORITIES",
    "PRIORITY_NORMAL",
    "PRIORITY_LATENCY",
    "Limits",
    "Request",
    "Hello",
    "Close",
    "Ping",
    "Wait",
    "ComputeRef",
    "RunGraph",
    "Define",
    "RegisterHost",
    "Unregister",
    "Alloc",
    "Free",
    "RegisterRemote",
    "Share",
    "Attach",
    "OpenRing",
    "OpenChannel",
    "RingMark",
    "Copy",
    "CopyV",
    "Fill",
    "Checksum",
    "ChecksumV",
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
    "check_ints",
    "int_bounds",
    "REQUEST_TYPES",
    "RESULTS",
    "result",
]

VERSION = 1


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


_definition = bounded()
#: A graph nests one level deeper: definition -> nodes -> node -> params -> a list parameter.
_graph_definition = bounded(max_depth=5)

#: Hello's priorities.
PRIORITY_NORMAL, PRIORITY_LATENCY = 0, 1
PRIORITIES = {"normal": PRIORITY_NORMAL, "latency": PRIORITY_LATENCY}

#: Define kinds.
DEF_ALLOC, DEF_FREE, DEF_TENSOR, DEF_PLAN, DEF_GRAPH = 1, 2, 3, 4, 5
#: A RunGraph binds at most this many VAs to the graph's inputs, and as many to its outputs.
GraphVAs = Annotated[list[U64], Meta(max_length=MAX_TENSORS)]


# --- requests ----------------------------------------------------------------
class Request(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """Base of every request; `id` is chosen by the client and echoed in the reply.

    On the wire a request is ``[op, id, field...]``: the Struct's tag is its op.
    Trailing fields that have a default may be left out; extra fields are refused.
    ``gc=False``: requests hold plain values, never a cycle, and skipping the
    collector's bookkeeping makes decoding a frame about 20% faster.
    """

    OP: ClassVar[int]
    id: RequestId


class Hello(Request, tag=1):
    """Open a session. `pid` lets a same-host daemon notice the client's death at once.
    `priority`: PRIORITY_NORMAL, or PRIORITY_LATENCY for a latency-sensitive tenant (its
    device streams are created at the device's greatest priority)."""

    version: U32 = VERSION
    client: Str256 = ""
    pid: Pid = 0
    token: Bin1024 = b""
    priority: U8 = 0


class Close(Request, tag=2):
    """End the session and release everything it owns."""


class Ping(Request, tag=3):
    """Heartbeat: keeps an idle session alive and proves the daemon is."""


class Wait(Request, tag=4):
    """Marks a frame whose replies the client blocks on: the daemon counts blocking round trips."""


class RingMark(Request, tag=5):
    """First in a frame that a session with a data channel sends while descriptors it pushed
    on its ring may still be on their way (docs/ring.md, "Remote rings"): the frame's
    requests go after the first `pushed` descriptors of the session's ring, as a same-host
    frame goes after what its ring held when it arrived. Answered nil, after the pass."""

    pushed: U64


class RegisterHost(Request, tag=10):
    """Create a shared-memory segment both sides map; reply {va, nbytes, path}."""

    nbytes: U64


class Unregister(Request, tag=11):
    """Release a host segment (by its base VA)."""

    va: U64


class Alloc(Request, tag=12):
    """Allocate a device buffer; device -1 lets the daemon choose. Reply {va, nbytes, device}."""

    nbytes: U64
    device: I32 = -1


class Free(Request, tag=13):
    """Free a device buffer (by its base VA)."""

    va: U64


class RegisterRemote(Request, tag=14):
    """Map a producer's NIXL-registered buffer as a `remote` segment; reply {va, nbytes, agent}.

    `metadata` is the producer's NIXL agent metadata (taken after registering),
    `descs` the buffer's descriptor list in the strict `encode_descs` layout (one
    range of exactly `nbytes` bytes). Both are untrusted: the daemon parses them
    strictly and only ever touches the declared range.

    `va` 0: the daemon chooses the VA. Otherwise a segment VA of one of the session's
    arenas, chosen by the client: a deferred registration, sent ahead of the first
    request that names it (then `site`, where the client's code registered it, names
    it in errors).
    """

    metadata: NixlMetadata
    descs: NixlDescs
    nbytes: U64
    va: U64 = 0
    site: Str256 = ""


class Share(Request, tag=16):
    """Grant other sessions use of a segment or buffer (base VA); reply {token}."""

    va: U64


class Attach(Request, tag=17):
    """Use a segment another session shared; reply {va, nbytes, kind, device}."""

    token: Bin64


class OpenRing(Request, tag=18):
    """Open this session's shared-memory request ring (same host only; docs/ring.md).

    Reply `_results.RingOpened`: the client collects the ring's memfd with `token` on
    the daemon's fd socket, and with `bell` a write end of the daemon's doorbell pipe, to
    which it writes a byte when the daemon sleeps. With `completion_bell`, `cbell` is a
    third token: the read end of a pipe the daemon writes to when it pushes completions
    to a client asleep on it (a waiter that polls fds, as trio does; others sleep on the
    ring's futex). `capacity` is rounded up to a power of two.
    """

    capacity: U32 = 1024
    completion_bell: bool = False


class OpenChannel(Request, tag=19):
    """Open this session's data channel: its ring carried over a TCP connection, for a
    client on another host (docs/ring.md, "Remote rings").

    Reply `_results.ChannelOpened`: the daemon's ring for the session is made, and waits
    for one connection to `port` on the host of the daemon's tcp endpoint, whose first bytes
    are the session's id and `key` (`transfer.ring._channel.HELLO`). The client keeps a ring
    of the same geometry in its own memory; `capacity` is rounded up to a power of two.
    """

    capacity: U32 = 1024


class Copy(Request, tag=20):
    """One copy of `nbytes` from `src` to `dst` (VAs); by far the most frequent request."""

    dst: U64
    src: U64
    nbytes: U64
    stream: U32 = 0


class CopyV(Request, tag=21):
    """Many copies in one request: three packed little-endian uint64 arrays of equal length.

    `sums`: answer the checksum64 of each piece as copied (what its destination holds after
    it), as ChecksumV answers, so a verified copy reads its bytes once and travels as one
    request instead of a copy and a checksum."""

    dst: np.ndarray
    src: np.ndarray
    nbytes: np.ndarray
    stream: U32 = 0
    sums: bool = False


class Fill(Request, tag=22):
    """Set `nbytes` bytes at `dst` to `value`."""

    dst: U64
    nbytes: U64
    value: U8 = 0
    stream: U32 = 0


class Checksum(Request, tag=23):
    """Read a range in place and reply with its checksum64."""

    src: U64
    nbytes: U64
    stream: U32 = 0


class ChecksumV(Request, tag=27):
    """checksum64 of many ranges in one request, answered as one packed little-endian
    uint64 array (msgpack bin) in the ranges' order: `src` and `nbytes` as in CopyV.

    On a ring it travels as one CHECKSUM descriptor per range, all with this id, each
    completed on its own (docs/ring.md)."""

    src: np.ndarray
    nbytes: np.ndarray
    stream: U32 = 0


class Compute(Request, tag=24):
    """Run an operator on tensors named by VA. device -1 and placement "" = the daemon's policy.

    Not decoded directly: TensorRef is a dataclass, which msgspec would read as
    a map. Frames carry a ``_ComputeWire``, turned into a Compute once checked.
    """

    op: Str64
    inputs: list[TensorRef]
    outputs: list[TensorRef]
    params: dict[str, Any]
    device: I32 = -1
    placement: Str32 = ""
    stream: U32 = 0


class _ComputeWire(Request, tag=24):
    """Compute as it travels: tensors as [va, dtype, shape, strides|nil] lists, checked by `tensors`."""

    op: Str64
    inputs: Any
    outputs: Any
    params: Any
    device: I32 = -1
    placement: Str32 = ""
    stream: U32 = 0


class ComputeRef(Request, tag=25):
    """Compute with a cached plan and tensor descriptors, named by client-side id and version."""

    plan: IdVersions
    inputs: IdVersions
    outputs: IdVersions
    stream: U32 = 0


class RunGraph(Request, tag=26):
    """Run a defined graph (Define kind 5) on inputs and outputs bound by VA.

    `graph` is the graph's VA: a segment of the session's arena, which holds the
    graph's intermediates. With `profile`, the result reports each operator's
    device, kernel and time; else it is nil.
    """

    graph: U64
    inputs: GraphVAs
    outputs: GraphVAs
    profile: bool = False
    stream: U32 = 0


class Define(Request, tag=50):
    """A deferred creation travelling with its first use: alloc, free, tensor or plan (see DEF_*)."""

    kind: U8
    obj: U64
    version: U32
    definition: Any
    site: Str256 = ""


class Fence(Request, tag=30):
    """Completes once every earlier request of the session on `stream` has."""

    stream: U32 = 0


class Stats(Request, tag=40):
    """Counters for this session and the daemon."""


REQUEST_TYPES: dict[int, type[Request]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (
        Hello,
        Close,
        Ping,
        Wait,
        RingMark,
        RegisterHost,
        Unregister,
        Alloc,
        Free,
        RegisterRemote,
        Share,
        Attach,
        OpenRing,
        OpenChannel,
        Copy,
        CopyV,
        Fill,
        Checksum,
        ChecksumV,
        Compute,
        ComputeRef,
        RunGraph,
        Define,
        Fence,
        Stats,
    )
}
for _op, _cls in REQUEST_TYPES.items():
    _cls.OP = _op
_ComputeWire.OP = Compute.OP
#: What the decoder reads for each op (Compute arrives as _ComputeWire).
_WIRE_TYPES: dict[int, type[Request]] = {**REQUEST_TYPES, Compute.OP: _ComputeWire}
_WireRequest = Union[tuple(_WIRE_TYPES.values())]  # type: ignore[valid-type]


class BadRequest(msgspec.Struct):
    """A request that could not be decoded; `id` is 0 when even that was unreadable."""

    id: int
    error: E.TransferError


class Reply(msgspec.Struct):
    """The outcome of one request: `error` is None on success."""

    id: int
    result: Any = None
    error: E.TransferError | None = None


Decoded = Union[Request, BadRequest]


# --- codec instances ------------------------------------------------------------
def _dec_hook(typ: type, obj: Any) -> Any:
    """CopyV and ChecksumV vectors travel as msgpack bin of packed little-endian uint64."""
    if typ is np.ndarray:
        if type(obj) is not bytes:
            raise TypeError(f"expected packed uint64 bytes, got {type(obj).__name__}")
        if len(obj) % 8:
            raise ValueError(f"length {len(obj)} is not a multiple of 8")
        return np.frombuffer(obj, dtype="<u8")
    raise NotImplementedError(typ)


_encoder = msgspec.msgpack.Encoder()  # requests and replies: plain msgpack values, nothing custom
# _WireRequest is a union built at run time, so mypy cannot read these two types: declared.
_frame_decoder: msgspec.msgpack.Decoder[tuple[int, list[Request]]] = msgspec.msgpack.Decoder(
    tuple[int, list[_WireRequest]], dec_hook=_dec_hook)  # type: ignore[valid-type]
_request_decoder: msgspec.msgpack.Decoder[Request] = msgspec.msgpack.Decoder(_WireRequest, dec_hook=_dec_hook)
_head_decoder = msgspec.msgpack.Decoder(tuple[Any, Raw])
_raw_list_decoder = msgspec.msgpack.Decoder(list[Raw])
_any_decoder = msgspec.msgpack.Decoder()


class _WireReply(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """[id, 0, result] or [id, code, name, message]; `value` is the result or the error's name."""

    id: int
    code: int
    value: Any
    message: str | UnsetType = UNSET


_reply_frame_decoder = msgspec.msgpack.Decoder(tuple[int, list[_WireReply]])


# --- framing ------------------------------------------------------------------
_FRAME_SHAPE = "a frame is [version, [message, ...]]"


def _array_len(buf: bytes | memoryview, at: int) -> int | None:
    """Length of the msgpack array whose header starts at `buf[at]`; None if none starts there."""
    if len(buf) <= at:
        return None
    b = buf[at]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(buf) >= at + 3:
        return int.from_bytes(buf[at + 1 : at + 3], "big")
    if b == 0xDD and len(buf) >= at + 5:
        return int.from_bytes(buf[at + 1 : at + 5], "big")
    return None


def _check_size(data: bytes, limits: Limits) -> None:
    if len(data) > limits.max_frame_bytes:
        raise E.FrameTooLarge(f"frame of {len(data)} bytes exceeds the limit of {limits.max_frame_bytes}")


def _check_count(n: int, limits: Limits, what: str) -> None:
    if n > limits.max_batch:
        raise E.BatchTooLarge(f"frame carries {n} {what}, the limit is {limits.max_batch}")


def _fast_count(data: bytes) -> int | None:
    """Messages in a frame that starts ``[VERSION, [``, read off the header bytes.

    Lets a huge batch be refused before anything is decoded; None sends the
    frame to the slow path, which decodes the header to say what is wrong.
    """
    if len(data) < 3 or data[0] != 0x92 or data[1] != VERSION:
        return None
    return _array_len(data, 2)


def _split(data: bytes, limits: Limits, what: str) -> list[Raw]:
    """The slow path's framing: header checked, body split into undecoded messages."""
    try:
        version, body = _head_decoder.decode(data)
    except msgspec.ValidationError:
        raise E.MalformedFrame(_FRAME_SHAPE) from None
    except Exception as exc:  # DecodeError, UnicodeDecodeError, RecursionError: not a frame
        raise E.MalformedFrame(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    if type(version) is not int:
        raise E.MalformedFrame("frame version must be an integer")
    if version != VERSION:
        raise E.UnsupportedVersion(f"protocol version {version} is not supported (this side speaks {VERSION})")
    n = _array_len(memoryview(body), 0)
    if n is None:
        raise E.MalformedFrame("frame body must be a list")
    _check_count(n, limits, what)
    return _raw_list_decoder.decode(body)


# --- requests: encoding -------------------------------------------------------
def _vector(v: Any) -> bytes:
    return np.ascontiguousarray(v, dtype="<u8").tobytes()


def _copyv_wire(r: CopyV) -> list[Any]:
    wire = [CopyV.OP, r.id, _vector(r.dst), _vector(r.src), _vector(r.nbytes), r.stream]
    return [*wire, True] if r.sums else wire


def _checksumv_wire(r: ChecksumV) -> list[Any]:
    return [ChecksumV.OP, r.id, _vector(r.src), _vector(r.nbytes), r.stream]


def _compute_wire(r: Compute) -> list[Any]:
    return [
        Compute.OP,
        r.id,
        r.op,
        [t.to_wire() for t in r.inputs],
        [t.to_wire() for t in r.outputs],
        r.params,
        r.device,
        r.placement,
        r.stream,
    ]


#: Requests msgspec cannot encode as they are: TensorRef (a dataclass) would become a
#: map, and vector requests' arrays may be any array-like (lists too), not just uint64 arrays.
_AS_WIRE: dict[type, Callable[[Any], list[Any]]] = {Compute: _compute_wire, CopyV: _copyv_wire, ChecksumV: _checksumv_wire}


def encode_requests(requests: Iterable[Request]) -> bytes:
    reqs: list[Any] = requests if type(requests) is list else list(requests)  # Requests, or their wire lists
    if not _AS_WIRE.keys().isdisjoint(map(type, reqs)):
        reqs = [_AS_WIRE[type(r)](r) if type(r) in _AS_WIRE else r for r in reqs]
    return _encoder.encode((VERSION, reqs))


# --- requests: checks after decoding --------------------------------------------
def _check_vector(name: str, vectors: tuple[np.ndarray, ...], limits: Limits) -> None:
    """A vector request's arrays: one length, within the batch and bin limits."""
    n = len(vectors[0])
    if any(len(v) != n for v in vectors):
        raise E.InvalidField(f"{name}: its vectors must have the same length")
    if n > limits.max_vector:
        raise E.BatchTooLarge(f"{name} of {n} ranges exceeds the limit of {limits.max_vector}")
    if n * 8 > limits.max_bin:
        raise E.InvalidField(f"{name}: vectors of {n * 8} bytes exceed max_bin {limits.max_bin}")


def _check_copyv(r: CopyV, limits: Limits) -> CopyV:
    _check_vector("CopyV", (r.dst, r.src, r.nbytes), limits)
    return r


def _check_checksumv(r: ChecksumV, limits: Limits) -> ChecksumV:
    _check_vector("ChecksumV", (r.src, r.nbytes), limits)
    return r


def _check_compute(w: _ComputeWire, limits: Limits) -> Compute:
    return Compute(
        w.id,
        w.op,
        tensors(w.inputs, "Compute.inputs"),
        tensors(w.outputs, "Compute.outputs"),
        params(w.params, "Compute.params"),
        w.device,
        w.placement,
        w.stream,
    )


def _check_define(r: Define, limits: Limits) -> Define:
    (_graph_definition if r.kind == DEF_GRAPH else _definition)(r.definition, "Define.definition")
    return r


#: Requests with rules no msgspec type expresses; everything else is done when decoded.
_AFTER: dict[type, Callable[[Any, Limits], Request]] = {
    CopyV: _check_copyv,
    ChecksumV: _check_checksumv,
    _ComputeWire: _check_compute,
    Define: _check_define,
}


def _after(req: Request, limits: Limits) -> Decoded:
    try:
        return _AFTER[type(req)](req, limits)
    except E.TransferError as exc:
        return BadRequest(req.id, exc)


# --- requests: the slow path, one request at a time -------------------------------
_FIELDS: dict[int, tuple[int, list[tuple[str, msgspec.msgpack.Decoder[Any]]]]] = {}


def _fields_of(op: int) -> tuple[int, list[tuple[str, msgspec.msgpack.Decoder[Any]]]]:
    """(required field count, [(name, decoder)]) of an op, built on first use."""
    if op not in _FIELDS:
        cls = _WIRE_TYPES[op]
        required = sum(1 for f in msgspec.structs.fields(cls)[1:] if f.required)
        decoders = [(f.name, msgspec.msgpack.Decoder(f.type, dec_hook=_dec_hook)) for f in msgspec.structs.fields(cls)[1:]]
        _FIELDS[op] = (required, decoders)
    return _FIELDS[op]


def _reason(exc: Exception) -> tuple[str, str]:
    """(path below the field, message) of a msgspec error: "Expected `int` - at `$[0]`"."""
    msg, _, path = str(exc).partition(" - at `$")
    return path.rstrip("`"), msg[:1].lower() + msg[1:]


def _value(raw: Raw) -> Any:
    try:
        return _any_decoder.decode(raw)
    except Exception:
        return UNSET


def _explain(raw: Raw, exc: Exception) -> BadRequest:
    """Why one request did not decode, as a BadRequest naming its id and field where readable."""
    try:
        parts = _raw_list_decoder.decode(raw)
    except Exception:
        parts = []
    if len(parts) < 2:
        return BadRequest(0, E.MalformedFrame("a request is [op, id, field...]"))
    op, rid = _value(parts[0]), _value(parts[1])
    if type(rid) is not int or not 0 < rid <= U64_MAX:
        return BadRequest(0, E.MalformedFrame("request id must be an integer in 1..2**64-1"))
    if type(op) is not int or op not in REQUEST_TYPES:
        return BadRequest(rid, E.UnknownOperation(f"unknown operation {op!r}"))
    name = REQUEST_TYPES[op].__name__
    required, fields = _fields_of(op)
    n = len(parts) - 2
    if not required <= n <= len(fields):
        takes = f"{len(fields)}" if required == len(fields) else f"{required} to {len(fields)}"
        return BadRequest(rid, E.InvalidField(f"{name} takes {takes} fields, got {n}"))
    for (field, decoder), part in zip(fields, parts[2:]):
        try:
            decoder.decode(part)
        except Exception as field_exc:
            path, msg = _reason(field_exc)
            got = _value(part) if not path else UNSET
            if got is None or type(got) in (bool, int, float):
                # the value beside the reason: "expected `int`, got `float` (1.5)", "expected `int` >= 0, got -1"
                msg = f"{msg} ({got!r})" if ", got `" in msg else f"{msg}, got {got!r}"
            return BadRequest(rid, E.InvalidField(f"{name}.{field}{path}: {msg}"))
    return BadRequest(rid, E.InvalidField(f"{name}: {_reason(exc)[1]}"))  # safety net: failures are per field


def _decode_one(raw: Raw, limits: Limits) -> Decoded:
    try:
        req = _request_decoder.decode(raw)
    except Exception as exc:  # ValidationError, DecodeError, UnicodeDecodeError, RecursionError
        return _explain(raw, exc)
    return _after(req, limits) if type(req) in _AFTER else req


def decode_request(item: Any, limits: Limits = DEFAULT_LIMITS) -> Decoded:
    """One request from its msgpack bytes (or its already-decoded list form); errors become BadRequest."""
    if not isinstance(item, (bytes, bytearray, memoryview, Raw)):
        try:
            item = _encoder.encode(item)
        except Exception:
            return BadRequest(0, E.MalformedFrame("a request is [op, id, field...]"))
    return _decode_one(Raw(item) if not isinstance(item, Raw) else item, limits)


def decode_requests(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[Decoded]:
    """A request frame -> its requests, each either typed or a BadRequest.

    Raises ProtocolError when the frame as a whole is unusable.
    """
    _check_size(data, limits)
    n = _fast_count(data)
    if n is not None:
        _check_count(n, limits, "requests")
        reqs: list[Request] | None
        try:
            reqs = _frame_decoder.decode(data)[1]
        except Exception:  # some request, or the frame, is bad: sorted out one by one below
            reqs = None
        if reqs is not None:
            if not _AFTER.keys().isdisjoint(map(type, reqs)):
                return [_after(r, limits) if type(r) in _AFTER else r for r in reqs]
            return cast("list[Decoded]", reqs)  # fresh from the decoder: nobody else holds it
    return [_decode_one(raw, limits) for raw in _split(data, limits, "requests")]


# --- replies ------------------------------------------------------------------
def encode_replies(replies: Iterable[Reply]) -> bytes:
    body = [
        (r.id, 0, r.result) if r.error is None else (r.id, r.error.code, type(r.error).__name__, r.error.message)
        for r in replies
    ]
    return _encoder.encode((VERSION, body))


def frame_error(err: E.TransferError) -> bytes:
    """The reply to a frame that could not be decoded at all."""
    return encode_replies([Reply(0, error=err)])


def decode_replies(data: bytes, limits: Limits = DEFAULT_LIMITS) -> list[Reply]:
    """A reply frame -> replies. The server is checked too: a client must not crash on bad bytes."""
    _check_size(data, limits)
    n = _fast_count(data)
    if n is None:
        _split(data, limits, "replies")  # an odd header: raises unless it is a frame after all
    else:
        _check_count(n, limits, "replies")
    try:
        body = _reply_frame_decoder.decode(data)[1]
    except msgspec.ValidationError as exc:
        raise E.MalformedFrame(f"a reply is [id, 0, result] or [id, code, name, message]: {exc}") from None
    except Exception as exc:
        raise E.MalformedFrame(f"undecodable frame: {type(exc).__name__}: {exc}") from None
    out: list[Reply] = []
    for w in body:
        if w.code == 0 and w.message is UNSET:
            if w.value is not None:
                check_result(w.value, limits)
            out.append(Reply(w.id, w.value))
        elif w.code > 0 and w.message is not UNSET:
            check_result(w.message, limits)
            out.append(Reply(w.id, error=E.error_for_code(w.code, w.message)))
        else:
            raise E.MalformedFrame("malformed reply status")
    return out


# --- results ------------------------------------------------------------------------
#: What a successful reply to each request carries (requests not named here: nil).
RESULTS: dict[type[Request], Any] = {
    Hello: R.HelloResult,
    RegisterHost: R.Registered,
    Alloc: R.Allocated,
    RegisterRemote: R.RemoteRegistered,
    Share: R.Shared,
    Attach: R.Attached,
    OpenRing: R.RingOpened,
    OpenChannel: R.ChannelOpened,
    Define: Union[R.Allocated, None],  # an alloc's definition answers what it allocated
    Checksum: U64,
    ChecksumV: bytes,
    CopyV: Union[bytes, None],  # (with `sums`)
    Compute: Union[U64, None],  # (the checksum operator)
    ComputeRef: Union[U64, None],
    RunGraph: Union[R.GraphProfile, None],
    Stats: dict[str, Any],
}


def result(cls: type[Request], value: Any) -> Any:
    """A reply's result to a `cls` request, checked against its declared type (RESULTS):
    a Struct for a map, else the value. Anything else is a MalformedFrame naming the field."""
    try:
        return msgspec.convert(value, RESULTS.get(cls, None))
    except msgspec.ValidationError as exc:
        raise E.MalformedFrame(f"the daemon's reply to {cls.__name__} is malformed: {exc}") from None


# --- submission-side checks -----------------------------------------------------
_INT_BOUNDS: dict[type, tuple[tuple[int, str, int, int], ...]] = {}
#: check_ints's common case in C: True when every field is an exact int in range (a NumPy
#: integer, or anything wrong, is left to the loop below, which names it).
_ints_within: Callable[[tuple[Any, ...], tuple[tuple[int, str, int, int], ...]], bool] = _native_ints_within


def int_bounds(cls: type) -> tuple[tuple[int, str, int, int], ...]:
    """(position after the id, field, lo, hi) for a request's integer fields (a vector
    request's arrays are not among them), from its own annotations."""
    bounds = _INT_BOUNDS.get(cls)
    if bounds is None:
        info = msgspec.inspect.type_info(cls)
        if not isinstance(info, msgspec.inspect.StructType):
            raise TypeError(f"{cls.__name__} is not a request")
        bounds = tuple(
            (i, f.name, f.type.ge if f.type.ge is not None else -(1 << 63), f.type.le if f.type.le is not None else U64_MAX)
            for i, f in enumerate(info.fields[1:])
            if isinstance(f.type, msgspec.inspect.IntType)
        )
        _INT_BOUNDS[cls] = bounds
    return bounds


def check_ints(cls: type, args: tuple[Any, ...]) -> None:
    """Refuse what no transport can carry before it is sent, in the decoder's words, so a
    request fails the same way whichever path (socket or ring) it would have taken.

    `args` are the request's fields after the id, in order (trailing defaults may be left
    out); only integer fields are checked.
    """
    bounds = _INT_BOUNDS.get(cls) or int_bounds(cls)
    if type(args) is tuple and _ints_within(args, bounds):
        return  # every field an exact int in range: one native call (submission's hot path)
    n = len(args)
    for i, name, lo, hi in bounds:
        if i >= n:
            break
        v = args[i]
        if type(v) is int and lo <= v <= hi:
            continue  # the common case, first
        if type(v) is not int:
            if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
                v = int(v)
            else:
                raise E.InvalidField(f"{cls.__name__}.{name}: expected `int`, got `{type(v).__name__}`")
        if v < lo:
            raise E.InvalidField(f"{cls.__name__}.{name}: expected `int` >= {lo}, got {v}")
        if v > hi:
            raise E.InvalidField(f"{cls.__name__}.{name}: expected `int` <= {hi}, got {v}")
