"""One exception hierarchy, each class with a stable wire code.

The server reports an error as ``(code, name, message)``; the client raises
the class registered for ``code``, so a caller catches the same exception
whether the check failed locally or in the daemon. Codes are part of the
protocol (docs/protocol.md): never renumber one, only add.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "TransferError",
    "ProtocolError",
    "MalformedFrame",
    "UnsupportedVersion",
    "FrameTooLarge",
    "BatchTooLarge",
    "UnknownOperation",
    "InvalidField",
    "AddressError",
    "UnknownSegment",
    "SegmentFreed",
    "NotOwner",
    "OutOfBounds",
    "InvalidAddress",
    "ResourceError",
    "OutOfSharedMemory",
    "QuotaExceeded",
    "OutOfDeviceMemory",
    "SegmentBusy",
    "SessionError",
    "NoSession",
    "SessionClosed",
    "RingUnavailable",
    "ShuttingDown",
    "ConnectionLost",
    "DaemonUnavailable",
    "RequestTimeout",
    "SlotError",
    "BackendError",
    "NixlUnavailable",
    "NixlError",
    "TransferFailed",
    "PeerDisconnected",
    "NotRegistered",
    "TransferTimeout",
    "RemoteRangeError",
    "DescriptorFormatError",
    "InternalError",
    "error_for_code",
]


class TransferError(Exception):
    """Root of every error `transfer` raises on purpose."""

    code: ClassVar[int] = 1
    #: Errors from the wire keep the server's message; local ones build their own.
    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.__class__.__name__)

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def to_wire(self) -> tuple[int, str, str]:
        return (self.code, type(self).__name__, self.message)


# --- 100: the frame or a request could not be understood -------------------
class ProtocolError(TransferError):
    """A frame or request violates the protocol."""

    code = 100


class MalformedFrame(ProtocolError):
    """The frame is not valid msgpack of the expected shape."""

    code = 101


class UnsupportedVersion(ProtocolError):
    """The peer speaks a protocol version this side does not."""

    code = 102


class FrameTooLarge(ProtocolError):
    """The frame exceeds the negotiated size limit."""

    code = 103


class BatchTooLarge(ProtocolError):
    """The frame carries more requests than the negotiated limit."""

    code = 104


class UnknownOperation(ProtocolError):
    """The request names an operation this server does not know."""

    code = 105


class InvalidField(ProtocolError):
    """A field has the wrong type, range or length."""

    code = 106


# --- 200: a virtual address failed translation ------------------------------
class AddressError(TransferError):
    """A virtual address range cannot be translated."""

    code = 200


class UnknownSegment(AddressError):
    """The VA names a segment that never existed."""

    code = 201


class SegmentFreed(AddressError):
    """The VA names a segment that has been freed."""

    code = 202


class NotOwner(AddressError):
    """The VA names a segment that belongs to another session."""

    code = 203


class OutOfBounds(AddressError):
    """The range runs past the end of its segment."""

    code = 204


class InvalidAddress(AddressError):
    """The VA or size is negative, overflows 64 bits, or is misaligned."""

    code = 205


# --- 300: resources ---------------------------------------------------------
class ResourceError(TransferError):
    """A resource could not be provided."""

    code = 300


class OutOfSharedMemory(ResourceError):
    """No memory left for the segment or ring (the machine, the memory cgroup, or --max-host-bytes)."""

    code = 301


class QuotaExceeded(ResourceError):
    """The request would exceed a session or daemon limit."""

    code = 302


class OutOfDeviceMemory(ResourceError):
    """The device cannot allocate the buffer."""

    code = 303


class SegmentBusy(ResourceError):
    """The segment is still in use by requests in flight."""

    code = 304


# --- 400: sessions ----------------------------------------------------------
class SessionError(TransferError):
    """The session is missing or no longer usable."""

    code = 400


class NoSession(SessionError):
    """The request arrived before hello, or after the session ended (daemon restart)."""

    code = 401


class SessionClosed(SessionError):
    """The session was closed; its resources are gone."""

    code = 402


class RingUnavailable(SessionError):
    """The session cannot have a shared-memory request ring (disabled, another host, or one is open)."""

    code = 403


class ShuttingDown(SessionError):
    """The daemon is shutting down: the request was not run (it arrived during the drain, or the grace ran out)."""

    code = 404


# --- 500: the connection (raised by clients, never sent) --------------------
class ConnectionLost(TransferError):
    """The daemon stopped answering or went away."""

    code = 500


class DaemonUnavailable(ConnectionLost):
    """No daemon answered at the endpoint."""

    code = 501


class RequestTimeout(ConnectionLost):
    """No completion arrived in time."""

    code = 502


class SlotError(TransferError):
    """A batch slot was used in a state that forbids it (in flight, released, released twice)."""

    code = 510


# --- 600+: the server side --------------------------------------------------
class BackendError(TransferError):
    """The device backend failed while executing a request."""

    code = 600


class DeviceFault(BackendError):
    """The GPU failed while executing the request (a CUDA error; from 700 on, the device's
    context is lost and every later request on it fails the same way)."""

    code = 601


class NixlUnavailable(BackendError, ImportError):
    """NIXL is not installed: install the ``rdma`` extra (see docs/rdma.md)."""

    code = 610


class NixlError(BackendError):
    """A NIXL call failed."""

    code = 611


class TransferFailed(NixlError):
    """A posted RDMA transfer completed with an error."""

    code = 612


class PeerDisconnected(TransferFailed):
    """The RDMA peer went away (process died, connection reset) during a transfer."""

    code = 613


class NotRegistered(NixlError):
    """A range is not inside our registrations or the peer's (NIXL_ERR_NOT_FOUND)."""

    code = 614


class TransferTimeout(NixlError, TimeoutError):
    """An RDMA transfer did not complete in time (it may still be in flight)."""

    code = 615


class RemoteRangeError(OutOfBounds):
    """A requested remote range is not inside any range the peer registered."""

    code = 206


class DescriptorFormatError(InvalidField):
    """Serialized RDMA descriptor bytes are malformed."""

    code = 107


class InternalError(TransferError):
    """A bug in the daemon; the request failed, the daemon keeps serving."""

    code = 900


def _all_subclasses(cls: type[TransferError]) -> list[type[TransferError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_CODE: dict[int, type[TransferError]] = {}
for _cls in _all_subclasses(TransferError):
    if _cls.code in _BY_CODE:  # pragma: no cover - caught by the test suite at import
        raise RuntimeError(f"duplicate wire code {_cls.code}: {_cls} and {_BY_CODE[_cls.code]}")
    _BY_CODE[_cls.code] = _cls


def as_transfer_error(exc: BaseException) -> TransferError:
    """`exc` if it is one of ours, else `BackendError` naming it: a failure under a request
    (a device, a kernel, NIXL) fails that request, and the daemon serves on."""
    return exc if isinstance(exc, TransferError) else BackendError(f"{type(exc).__name__}: {exc}")


def error_for_code(code: int, message: str) -> TransferError:
    """Rebuild the exception a peer reported; unknown codes keep their number."""
    cls = _BY_CODE.get(code)
    if cls is None:
        err = TransferError(f"[code {code}] {message}")
        return err
    return cls(message)


def register(cls: type[TransferError]) -> type[TransferError]:
    """Register an error class defined in a later module (keeps codes unique)."""
    if cls.code in _BY_CODE and _BY_CODE[cls.code] is not cls:
        raise RuntimeError(f"duplicate wire code {cls.code}")
    _BY_CODE[cls.code] = cls
    return cls
