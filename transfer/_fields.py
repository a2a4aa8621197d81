"""Field types and validators of the protocol (transfer.protocol re-exports them).

Two layers: msgspec types (``U64``, ``Str256``, ...) say what msgspec checks
while it decodes, in C; the validators check what a type cannot say (tensor
rules, parameter maps, bounded values) after decoding, and name the field in
every error. The server reuses the validators on deferred definitions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from msgspec import Meta

from . import errors as E
from .kernels import DTYPES, MAX_DIMS, TensorRef, tensor_extent, tensor_nbytes

U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
I32_MIN, I32_MAX = -(1 << 31), (1 << 31) - 1


# --- wire types: what msgspec checks while decoding ---------------------------
# msgpack integers stop at 2**64-1, so `ge` alone makes a u64 (msgspec bounds must fit an int64).
U64 = Annotated[int, Meta(ge=0)]
U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]
U8 = Annotated[int, Meta(ge=0, le=255)]
I32 = Annotated[int, Meta(ge=I32_MIN, le=I32_MAX)]
RequestId = Annotated[int, Meta(ge=1)]
#: No Linux pid, in any pid namespace, exceeds PID_MAX_LIMIT (include/linux/threads.h: 2**22
#: on 64-bit): a pid is declared as what the kernel can hand out, not as the u32 it fits in,
#: so it is always a valid pid_t for os.pidfd_open and /proc.
PID_MAX = 1 << 22
Pid = Annotated[int, Meta(ge=0, le=PID_MAX)]
Str32 = Annotated[str, Meta(max_length=32)]
Str64 = Annotated[str, Meta(max_length=64)]
Str256 = Annotated[str, Meta(max_length=256)]
Bin64 = Annotated[bytes, Meta(max_length=64)]
Bin1024 = Annotated[bytes, Meta(max_length=1024)]

MAX_TENSORS = 16
MAX_PARAMS = 32
MAX_PARAM_LIST = 4096
#: NIXL agent metadata and serialized descriptor lists (transfer.transport._nixl) are small.
MAX_NIXL_METADATA = 1 << 20
MAX_NIXL_DESCS = 1 << 16
NixlMetadata = Annotated[bytes, Meta(max_length=MAX_NIXL_METADATA)]
NixlDescs = Annotated[bytes, Meta(max_length=MAX_NIXL_DESCS)]
#: [[id, version], ...] references to definitions cached by the daemon.
IdVersions = Annotated[list[tuple[U64, U32]], Meta(max_length=MAX_TENSORS)]


# --- field validators for what the types cannot say: (value, name) -> value ---
# Also used by the server to check deferred definitions (server/_deferred.py).
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
#: No tensor presents more element bytes, or spans more bytes, than the largest segment
#: (addressing.MAX_SEGMENT_BYTES, 1 TiB); the planner then bounds both by the real segment.
MAX_TENSOR_BYTES = 1 << 40
_dimension = _int_range(0, MAX_TENSOR_BYTES, "dimension")
_stride = _int_range(0, MAX_TENSOR_BYTES, "stride")


def text(max_len: int) -> Validator:
    def check(v: Any, name: str) -> str:
        if type(v) is not str:
            raise E.InvalidField(f"{name}: expected str, got {type(v).__name__}")
        if len(v) > max_len:
            raise E.InvalidField(f"{name}: longer than {max_len} characters")
        return v

    return check


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
            _dimension(d, f"{where}.shape")
        if strides is not None:
            if type(strides) is not list or len(strides) != len(shape):
                raise E.InvalidField(f"{where}.strides: expected nil or one stride per dimension")
            for st_ in strides:
                _stride(st_, f"{where}.strides")
        ref = TensorRef(va, dtype, tuple(shape), None if strides is None else tuple(strides))
        # Exact integers: a product of 8 dims of 2**40 cannot overflow, only be refused.
        if tensor_nbytes(ref) > MAX_TENSOR_BYTES or tensor_extent(ref) > MAX_TENSOR_BYTES:
            raise E.InvalidField(f"{where}.shape: the tensor's elements exceed {MAX_TENSOR_BYTES} bytes")
        out.append(ref)
    return out


def i64_or_u64(v: int, where: str) -> int:
    if not -(1 << 63) <= v <= U64_MAX:
        raise E.InvalidField(f"{where}: integer out of 64-bit range")
    return v


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
        else:  # msgpack ext values (msgspec.msgpack.Ext, datetime) land here
            raise E.InvalidField(f"{name}: unsupported type {type(v).__name__}")

    def check(v: Any, name: str) -> Any:
        walk(v, 0, name)
        return v

    return check


_definition = bounded()


# --- replies -------------------------------------------------------------------
MAX_RESULT_DEPTH = 32


def check_result(v: Any, limits: Any, depth: int = 0) -> None:
    """A reply's result holds plain msgpack values within `limits` (a protocol.Limits): no ext, string keys."""
    if depth > MAX_RESULT_DEPTH:
        raise E.MalformedFrame(f"reply nested deeper than {MAX_RESULT_DEPTH}")
    t = type(v)
    if v is None or t is bool or t is int or t is float:
        return
    if t is str:
        if len(v) > limits.max_str * 4 and len(v.encode()) > limits.max_str * 4:
            raise E.MalformedFrame(f"reply string longer than {limits.max_str * 4} bytes")
    elif t is bytes:
        if len(v) > limits.max_bin:
            raise E.MalformedFrame(f"reply bytes longer than {limits.max_bin}")
    elif t is list:
        if len(v) > max(limits.max_batch, 16):
            raise E.MalformedFrame(f"reply list longer than {max(limits.max_batch, 16)}")
        for e in v:
            check_result(e, limits, depth + 1)
    elif t is dict:
        if len(v) > 64:
            raise E.MalformedFrame("reply map of more than 64 entries")
        for k, e in v.items():
            if type(k) is not str and type(k) is not bytes:
                raise E.MalformedFrame("reply map keys must be strings")
            check_result(e, limits, depth + 1)
    else:
        raise E.MalformedFrame(f"unsupported value in reply: {t.__name__}")
