"""A hostile daemon for the `fake_daemon` attack: the client's side of the soak.

A zmq ROUTER on a private ipc endpoint and a Unix fd socket, each served by a thread of
the attacker's process, answer a real `transfer.connect(...)` client. Each reply is valid
unless the `Breakage` armed for its request type says otherwise: a key dropped or
replaced by a random msgpack value (NaN, out-of-range integers included), one number
anywhere in it (nested too) set to where integer widths end or to NaN/inf, the whole
result replaced, an error with a code no daemon sends, a frame of garbage; or a handover
of the wrong thing (an unsealed memfd, a memfd of another size, a pipe, a ring whose
header is garbage, a bell that is not a pipe's write end, a refusal, an empty reply).

Every reply that breaks a request is followed by the valid one, so a client that
ignores the broken frame still gets its answer: a call never waits on the fake.
"""

from __future__ import annotations

import array
import math
import os
import random
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import zmq

from transfer import _results as R
from transfer import protocol as P
from transfer._fields import PID_MAX
from transfer.ring import Ring
from transfer.memory._shm import new_memfd, reserve, seal

KiB = 1 << 10
U64 = (1 << 64) - 1
#: Integers where widths change, and each type's ends.
EDGE_INTS = (0, -1, 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, U64, -(1 << 63), PID_MAX + 1)
EDGE_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -1.0, 1e-300, 1e308)
#: What each request's valid reply carries (None: nil); a request type not here gets nil.
SEGMENT_VA, BUFFER_VA, ATTACHED_VA = 5 << 40, 6 << 40, 7 << 40


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack value, small, biased to what breaks parsers: NaN, the ends of integer widths."""
    kinds = ["none", "bool", "edge", "int", "float", "nan", "str", "bin"] + (["list", "map"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "edge":
        return rng.choice(EDGE_INTS)
    if kind == "int":
        return rng.randint(-(1 << 63), U64)
    if kind == "float":
        return rng.choice([0.0, -1.0, 1e308, -0.0, math.inf, -math.inf, rng.uniform(-1e6, 1e6)])
    if kind == "nan":
        return math.nan
    if kind == "str":
        return rng.choice(["", "x" * rng.randint(1, 300), "/", "\x00", "é" * 8, "host", "device", "remote"])
    if kind == "bin":
        return os.urandom(rng.choice([0, 1, 15, 16, 17, 64]))
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["va", "nbytes", "token", "x", ""]): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


# --- what the fake hands over on its fd socket -----------------------------------------------
def sealed_memfd(nbytes: int, seals: bool = True) -> int:
    fd = new_memfd("fake")
    reserve(fd, nbytes, "fake")
    if seals:
        seal(fd)
    return fd


def ring_memfd(capacity: int = 64, garbage: bytes | None = None) -> int:
    fd = new_memfd("fake-ring")
    reserve(fd, Ring.nbytes_for(capacity), "fake ring")
    if garbage is None:
        Ring.create(fd, capacity).close()  # (the caller keeps the fd it passes)
    else:
        os.pwrite(fd, garbage, 0)
    seal(fd)
    return fd


def pipe_end(which: int) -> int:
    r, w = os.pipe()
    os.close(w if which == 0 else r)
    return r if which == 0 else w


#: A segment's handover gone wrong (the client asked for 4 KiB): an fd, or the raw reply.
SEGMENT_HANDOVERS: dict[str, Callable[[], int | bytes]] = {
    "unsealed_memfd": lambda: sealed_memfd(4 * KiB, seals=False),
    "other_size": lambda: sealed_memfd(8 * KiB),
    "smaller": lambda: sealed_memfd(KiB),
    "pipe": lambda: pipe_end(0),
    "refused": lambda: b"\x01no",
    "garbage_reply": lambda: b"\x07\x07",
    "empty": lambda: b"",
    "ok_then_junk": lambda: b"\x00" + os.urandom(40),  # OK without an fd
}
#: A ring's handover gone wrong: (the ring's memfd, the bell) makers.
RING_HANDOVERS: dict[str, tuple[Callable[[], int | bytes], Callable[[], int | bytes]]] = {
    "header_garbage": (lambda: ring_memfd(garbage=os.urandom(4096)), lambda: pipe_end(1)),
    "header_zeros": (lambda: ring_memfd(garbage=bytes(4096)), lambda: pipe_end(1)),
    "unsealed_ring": (lambda: sealed_memfd(Ring.nbytes_for(64), seals=False), lambda: pipe_end(1)),
    "bell_memfd": (ring_memfd, lambda: sealed_memfd(4096)),
    "bell_read_end": (ring_memfd, lambda: pipe_end(0)),
    "ring_is_pipe": (lambda: pipe_end(0), lambda: pipe_end(1)),
    "bell_refused": (ring_memfd, lambda: b"\x01no"),
}


class FdServer:
    """A fd socket that hands out whatever its offer's maker returns: an fd, or raw reply bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offers: dict[bytes, Callable[[], int | bytes]] = {}
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.thread = threading.Thread(target=self._serve, name="fake-fds", daemon=True)
        self.thread.start()

    def offer(self, make: Callable[[], int | bytes]) -> bytes:
        token = secrets.token_bytes(16)
        self.offers[token] = make
        return token

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    token = conn.recv(64)
                    make = self.offers.pop(token, None)
                    made = make() if make is not None else b"\x01unknown"
                    if isinstance(made, bytes):
                        conn.send(made)
                        continue
                    try:
                        conn.sendmsg([b"\x00"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [made]))])
                    finally:
                        os.close(made)
                except OSError:
                    continue

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)
        self.path.unlink(missing_ok=True)


def number_paths(v: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], type]]:
    """Where a result holds a number (nested maps and lists too), with its type."""
    if type(v) in (int, float):
        return [(path, type(v))]
    if isinstance(v, dict):
        return [p for k in sorted(v) for p in number_paths(v[k], (*path, k))]
    if isinstance(v, list):
        return [p for i, e in enumerate(v) for p in number_paths(e, (*path, i))]
    return []


def replaced_at(v: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A copy of `v` with the value at `path` replaced."""
    if not path:
        return value
    out = dict(v) if isinstance(v, dict) else list(v)
    out[path[0]] = replaced_at(v[path[0]], path[1:], value)
    return out


@dataclass
class Breakage:
    """How the fake breaks its reply to one request type.

    kind: "drop" / "replace" / "extra" (a key), "edge" (the `pick`th number anywhere in the
    result set to `value`: an integer width's end, or NaN/inf for a float), "anything" (the
    whole result), "error" (an error reply whose code or message is wrong), "frame" (raw
    bytes instead of a reply frame), "handover" (RegisterHost, OpenRing: what the fd socket
    hands over)."""

    target: type[P.Request]
    kind: str
    pick: int = 0
    value: Any = None
    handover: str = ""
    applied: str = ""  # what "edge" set, where: "arenas.0.count=4294967295"

    def result(self, valid: Any) -> Any:
        if self.kind == "edge":
            numbers = number_paths(valid)
            if not numbers:
                return self.value
            path, typ = numbers[self.pick % len(numbers)]
            edges = EDGE_FLOATS if typ is float else EDGE_INTS
            value = self.value if type(self.value) is typ else edges[self.pick % len(edges)]
            self.applied = f"{'.'.join(map(str, path))}={value}"
            return replaced_at(valid, path, value)
        if self.kind == "anything" or not isinstance(valid, dict) or not valid:
            return self.value
        out = dict(valid)
        key = sorted(out)[self.pick % len(out)]
        if self.kind == "drop":
            del out[key]
        elif self.kind == "replace":
            out[key] = self.value
        else:
            out[f"extra{self.pick}"] = self.value  # a newer daemon's key: the client must accept it
        return out

    def __str__(self) -> str:
        what = self.handover or self.applied or f"{self.pick}:{self.value!r}"[:60]
        return f"{self.target.__name__}/{self.kind}/{what}"


def draw_breakage(rng: random.Random, target: type[P.Request], edges: bool = False) -> Breakage:
    """A random breakage of `target`'s replies; with `edges`, always an "edge" one."""
    kinds = ["drop", "replace", "replace", "extra", "anything", "error", "frame"]
    if target in (P.RegisterHost, P.OpenRing):
        kinds += ["handover"] * 3
    kind = "edge" if edges else rng.choice(kinds)
    handover = ""
    if kind == "handover":
        handover = rng.choice(sorted(SEGMENT_HANDOVERS if target is P.RegisterHost else RING_HANDOVERS))
    value = rng.choice(EDGE_INTS + EDGE_FLOATS) if kind == "edge" else random_value(rng)
    return Breakage(target, kind, rng.randrange(64), value, handover)


def hello_edges(fake: "FakeDaemon") -> list[Breakage]:
    """Every number of a valid hello reply at every edge value: each one alone."""
    return [Breakage(P.Hello, "edge", i, v) for i, (_, typ) in enumerate(number_paths(fake.hello()))
            for v in (EDGE_FLOATS if typ is float else EDGE_INTS)]


def _bad_frame(rng: random.Random, rid: int) -> bytes:
    """A reply frame no daemon sends."""
    makers: list[Callable[[], bytes]] = [
        lambda: os.urandom(rng.randint(0, 64)),
        lambda: msgpack.packb([P.VERSION, [[rid, 0]]]),  # a reply of two fields
        lambda: msgpack.packb([P.VERSION + 1, [[rid, 0, None]]]),
        lambda: msgpack.packb([P.VERSION, [[rid, 0, None, "stray"]]]),
        lambda: msgpack.packb([P.VERSION, [[rng.choice([-1, 1 << 63, U64, 0]), 0, None]]]),
        lambda: msgpack.packb([P.VERSION, [[rid, 0, msgpack.ExtType(5, b"xx")]]]),
        lambda: b"\x92\x01\xdd\xff\xff\xff\xff",  # claims 2**32-1 replies
        lambda: b"\x92\x01\x91" + b"\x91" * 5000 + b"\xc0",  # nested deep
        lambda: msgpack.packb([P.VERSION, "not a list"]),
    ]
    return rng.choice(makers)()


def _error_reply(rng: random.Random, rid: int) -> bytes:
    code = rng.choice([0, -1, 1, 2, 99, 9999, 1 << 40, U64])
    message = rng.choice([random_value(rng), "boom", None, {"x": 1}])
    frame: bytes = msgpack.packb([P.VERSION, [[rid, code, rng.choice(["NoSuchError", "", 7]), message]]], use_bin_type=True)
    return frame


class FakeDaemon:
    """The ROUTER and the fd socket. `arm(breakage)` breaks the next replies to its target."""

    def __init__(self, directory: Path, rng: random.Random) -> None:
        self.dir = directory
        self.rng = rng
        self.fds = FdServer(directory / "fds")
        self.endpoint = f"ipc://{directory}/fake.sock"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.breakage: Breakage | None = None
        self.broke = 0  # replies broken so far
        self.errors: list[str] = []  # the fake's own failures (the harness's, not the client's)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="fake-daemon", daemon=True)
        self.thread.start()

    def arm(self, breakage: Breakage | None) -> None:
        self.breakage = breakage

    # --- valid replies -----------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        info = msgspec.to_builtins(R.HelloResult(
            session=1, server_pid=os.getpid(), version=P.VERSION, limits=R.WireLimits(**P.Limits().to_wire()),
            max_inflight=1024, backend={"backend": "fake"}, devices=[R.DeviceInfo(0, "cpu", "fake")],
            heartbeat_s=0.5, session_timeout_s=5.0, shm_dir=str(self.dir), fd_socket=str(self.fds.path),
            home_device=0, arenas=[R.Arena(0, 1 << 10, 16, 1 << 30)],
        ))
        return info  # type: ignore[no-any-return]

    def valid(self, req: Any, handover: str = "") -> Any:
        t = type(req)
        if t is P.Hello:
            return self.hello()
        if t is P.RegisterHost:
            make = SEGMENT_HANDOVERS[handover] if handover else (lambda: sealed_memfd(4 * KiB))
            return {"va": SEGMENT_VA, "nbytes": 4 * KiB, "token": self.fds.offer(make)}
        if t is P.OpenRing:
            ring, bell = RING_HANDOVERS[handover] if handover else (ring_memfd, lambda: pipe_end(1))
            return {"token": self.fds.offer(ring), "bell": self.fds.offer(bell), "cbell": None, "capacity": 64,
                    "completion_capacity": 64, "graphs": True, "after": True}
        if t is P.Alloc:
            return {"va": BUFFER_VA, "nbytes": req.nbytes, "device": 0}
        if t is P.Share:
            return {"token": b"t" * 16}
        if t is P.Attach:
            return {"va": ATTACHED_VA, "nbytes": 4 * KiB, "kind": "host", "device": -1}
        if t is P.Stats:
            return {"daemon": {}, "session": {}}
        if t is P.Checksum:
            return 12345
        if t is P.ChecksumV:
            return bytes(8 * len(req.src))
        return None

    # --- the ROUTER's thread -----------------------------------------------------------------
    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                if not self.sock.poll(50):
                    continue
                ident, *rest = self.sock.recv_multipart()
                self._answer(ident, rest[-1] if rest else b"")
            except Exception as exc:  # noqa: BLE001 - the fake's own bug: counted by the attack, not fatal
                if self.stop.is_set():
                    return
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])

    def _answer(self, ident: bytes, frame: bytes) -> None:
        out: list[list[Any]] = []
        later: list[bytes] = []  # the valid replies that follow a broken frame
        for req in P.decode_requests(frame):
            if not isinstance(req, P.Request):
                continue
            b = self.breakage
            if b is None or type(req) is not b.target:
                out.append([req.id, 0, self.valid(req)])
                continue
            self.broke += 1
            if b.kind == "handover":
                out.append([req.id, 0, self.valid(req, b.handover)])
            elif b.kind == "error":
                self.sock.send_multipart([ident, _error_reply(self.rng, req.id)])
                later.append(msgpack.packb([P.VERSION, [[req.id, 0, self.valid(req)]]], use_bin_type=True))
            elif b.kind == "frame":
                self.sock.send_multipart([ident, _bad_frame(self.rng, req.id)])
                later.append(msgpack.packb([P.VERSION, [[req.id, 0, self.valid(req)]]], use_bin_type=True))
            else:
                out.append([req.id, 0, b.result(self.valid(req))])
        if out:
            self.sock.send_multipart([ident, msgpack.packb([P.VERSION, out], use_bin_type=True)])
        for f in later:
            self.sock.send_multipart([ident, f])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()
        self.fds.close()
