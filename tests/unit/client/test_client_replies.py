"""The client against a hostile daemon: whatever a reply or a handed-over descriptor holds,
nothing but a TransferError (or an OSError, where the operating system speaks) leaves the
client, and nothing it accepts is outside its declared type.

A fake daemon (a real zmq ROUTER and a real fd socket, in threads of this process) answers
the real clients' requests with valid replies that hypothesis then breaks: keys dropped,
values replaced by any msgpack value, numbers at and past their bounds, NaN; and hands over
descriptors of the wrong kind, size or shape.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import msgpack
import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transfer
from transfer import _results as R
from transfer import protocol as P

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from _hostile.fake_daemon import FdServer, pipe_end, ring_memfd, sealed_memfd  # noqa: E402  (the soak's own)

KiB = 1 << 10

# --- the fake daemon --------------------------------------------------------------------------


class FakeDaemon:
    """Answers each request with `answer(request)`: a result to encode, or raw reply-frame bytes."""

    def __init__(self, tmp: Path, answer: Callable[[Any], Any]) -> None:
        self.shm_dir = tmp / "shm"
        self.shm_dir.mkdir(mode=0o700)
        self.fds = FdServer(self.shm_dir / "fds")
        self.endpoint = f"ipc://{tmp}/fake.sock"
        self.answer = answer
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def hello(self, **changes: Any) -> dict[str, Any]:
        info = msgspec.to_builtins(R.HelloResult(
            session=1, server_pid=os.getpid(), version=P.VERSION, limits=R.WireLimits(**P.Limits().to_wire()),
            max_inflight=1024, backend={"backend": "fake"}, devices=[R.DeviceInfo(0, "cpu", "fake")],
            heartbeat_s=0.5, session_timeout_s=5.0, shm_dir=str(self.shm_dir), fd_socket=str(self.fds.path),
            home_device=0, arenas=[R.Arena(0, 1 << 10, 16, 1 << 30)],
        ))
        info.update(changes)
        return info  # type: ignore[no-any-return]

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, frame = self.sock.recv_multipart()
            out = []
            for req in P.decode_requests(frame):
                got = self.answer(req) if isinstance(req, P.Request) else None
                if isinstance(got, bytes):
                    self.sock.send_multipart([ident, got])
                    continue
                out.append([req.id, 0, got])
            if out:
                self.sock.send_multipart([ident, msgpack.packb([P.VERSION, out], use_bin_type=True)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()
        self.fds.close()


# --- hostile values ---------------------------------------------------------------------------
leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.binary(max_size=24), st.sampled_from([float("nan"), -1, 1 << 31, 1 << 32, (1 << 64) - 1, 0]),
)
values = st.recursive(leaves, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3), max_leaves=8)


class Mutation:
    """One way to break a valid reply, drawn ahead (the fake daemon applies it in its thread):
    a key dropped, a value replaced, a key added, or the whole result replaced."""

    def __init__(self, kind: str, pick: int, value: Any, key: str) -> None:
        self.kind, self.pick, self.value, self.key = kind, pick, value, key

    def __call__(self, valid: Any) -> Any:
        if self.kind == "anything" or not isinstance(valid, dict) or not valid:
            return self.value
        out = dict(valid)
        key = sorted(out)[self.pick % len(out)]
        if self.kind == "drop":
            del out[key]
        elif self.kind == "replace":
            out[key] = self.value
        else:
            out[self.key] = self.value  # a newer daemon's key: allowed
        return out

    def __repr__(self) -> str:
        return f"Mutation({self.kind!r}, {self.pick}, {self.value!r}, {self.key!r})"


mutations = st.builds(Mutation, st.sampled_from(["drop", "replace", "replace", "extra", "anything"]),
                      st.integers(0, 64), values, st.text(min_size=1, max_size=6))


@st.composite
def broken(draw: st.DrawFn, valid: dict[str, Any]) -> Any:
    """`valid` with one thing wrong, or anything at all."""
    return draw(mutations)(valid)


def survives(call: Callable[[], Any]) -> Any:
    """Run `call`: it may succeed or raise TransferError / OSError, nothing else."""
    try:
        return call()
    except (transfer.TransferError, OSError):
        return None


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)


def connect(fake: FakeDaemon, **kwargs: Any) -> Any:
    return transfer.connect(fake.endpoint, connect_timeout=3.0, liveness_timeout=3.0, watch_daemon_pid=False, **kwargs)


def answering(hello: Callable[[], Any], others: Callable[[Any], Any] = lambda req: None) -> Callable[[Any], Any]:
    return lambda req: hello() if isinstance(req, P.Hello) else others(req)


# --- tests -------------------------------------------------------------------------------------
def test_any_hello_reply(tmp_path: Path) -> None:
    box: dict[str, Any] = {}
    fake = FakeDaemon(tmp_path, answering(lambda: box["hello"]))
    try:
        @SETTINGS
        @given(st.data())
        def run(data: st.DataObject) -> None:
            box["hello"] = data.draw(broken(fake.hello()))
            c = survives(lambda: connect(fake, ring=False))
            if c is not None:  # what it accepted is within its declared types
                assert math.isfinite(c._core.heartbeat_s) and c._core.heartbeat_s > 0
                assert 0 < c.server_pid <= P.PID_MAX and c._core.max_inflight >= 1
                c.close()

        run()
    finally:
        fake.close()


@pytest.mark.parametrize("request_type", [P.RegisterHost, P.Alloc, P.Share, P.Attach, P.Stats, P.Checksum, P.Fence])
def test_any_reply_to_a_call(tmp_path: Path, request_type: type) -> None:
    box: dict[str, Any] = {}

    def valid(req: Any) -> Any:
        if type(req) is P.RegisterHost:
            token = fake.fds.offer(lambda: sealed_memfd(4 * KiB))
            return {"va": 5 << 40, "nbytes": 4 * KiB, "token": token}
        if type(req) is P.Alloc:
            return {"va": 6 << 40, "nbytes": req.nbytes, "device": 0}
        if type(req) is P.Share:
            return {"token": b"t" * 16}
        if type(req) is P.Attach:
            return {"va": 7 << 40, "nbytes": 4 * KiB, "kind": "host", "device": -1}
        if type(req) is P.Stats:
            return {"daemon": {}, "session": {}}
        if type(req) is P.Checksum:
            return 12345
        return None

    def answer(req: Any) -> Any:
        good = valid(req)
        if type(req) is request_type and box.get("mutate"):
            return box["reply"](good)
        return good

    fake = FakeDaemon(tmp_path, answering(lambda: fake.hello(), answer))
    c = connect(fake, ring=False, deferred=False)
    calls: dict[type, Callable[[], Any]] = {
        P.RegisterHost: lambda: c.segment(4 * KiB),
        P.Alloc: lambda: c.alloc(4 * KiB),
        P.Share: lambda: c.share(c.alloc(4 * KiB)),
        P.Attach: lambda: c.attach(b"t" * 16),
        P.Stats: lambda: c.stats(),
        P.Checksum: lambda: c.checksum(5 << 40, 4 * KiB).result(3),
        P.Fence: lambda: c.fence(),
    }
    try:
        @SETTINGS
        @given(st.data())
        def run(data: st.DataObject) -> None:
            box["reply"] = data.draw(mutations)
            box["mutate"] = True
            got = survives(calls[request_type])
            box["mutate"] = False
            if request_type is P.Checksum and got is not None:
                assert type(got) is int and 0 <= got < 1 << 64
            if c._core.broken is not None:  # a reply it could not trust ended the session: a new one
                c.close()
                box["client"] = connect(fake, ring=False, deferred=False)

        box["client"] = c
        run()
    finally:
        box["client"].close()
        fake.close()


HANDOVERS: dict[str, Callable[[], Any]] = {
    "unsealed memfd": lambda: sealed_memfd(4 * KiB, seals=False),
    "sealed, another size": lambda: sealed_memfd(8 * KiB),
    "a pipe": lambda: pipe_end(0),
    "refused": lambda: b"\x01no",
    "garbage reply": lambda: b"\x07\x07",
    "empty": lambda: b"",
}


@pytest.mark.parametrize("what", sorted(HANDOVERS))
def test_a_segment_handed_over_wrong_is_refused(tmp_path: Path, what: str) -> None:
    fake = FakeDaemon(tmp_path, answering(lambda: fake.hello(), lambda req: (
        {"va": 5 << 40, "nbytes": 4 * KiB, "token": fake.fds.offer(HANDOVERS[what])} if type(req) is P.RegisterHost else None)))
    try:
        with connect(fake, ring=False) as c:
            with pytest.raises(transfer.TransferError):
                c.segment(4 * KiB)
    finally:
        fake.close()


RINGS: dict[str, Callable[[FakeDaemon], dict[str, Any]]] = {
    "a header of garbage": lambda f: {"token": f.fds.offer(lambda: ring_memfd(garbage=os.urandom(4096))), "bell": f.fds.offer(lambda: pipe_end(1))},
    "a header of zeros": lambda f: {"token": f.fds.offer(lambda: ring_memfd(garbage=bytes(4096))), "bell": f.fds.offer(lambda: pipe_end(1))},
    "another capacity": lambda f: {"token": f.fds.offer(ring_memfd), "bell": f.fds.offer(lambda: pipe_end(1)), "capacity": 128},
    "a bell that is a memfd": lambda f: {"token": f.fds.offer(ring_memfd), "bell": f.fds.offer(lambda: sealed_memfd(4096))},
    "a bell's read end": lambda f: {"token": f.fds.offer(ring_memfd), "bell": f.fds.offer(lambda: pipe_end(0))},
}


@pytest.mark.parametrize("what", sorted(RINGS))
def test_a_ring_handed_over_wrong_is_refused(tmp_path: Path, what: str) -> None:
    def ring(req: Any) -> Any:
        if type(req) is not P.OpenRing:
            return None
        return {"cbell": None, "capacity": 64, "completion_capacity": 64, "graphs": True, "after": True, **RINGS[what](fake)}

    fake = FakeDaemon(tmp_path, answering(lambda: fake.hello(), ring))
    try:
        with pytest.raises(transfer.TransferError):
            connect(fake, ring=True)
        with pytest.raises(transfer.TransferError):
            connect(fake)  # (by default too: a daemon that hands over such a ring is not to be trusted)
    finally:
        fake.close()


@pytest.mark.parametrize("arena", [
    {"count": (1 << 31) - 1}, {"count": (1 << 32) - 1}, {"count": (1 << 22) + 1}, {"count": 0}, {"first_id": 0},
    {"first_id": 1 << 24}, {"first_id": (1 << 24) - 2, "count": 5}, {"quota": -1}, {"device": -1},
])
def test_an_arena_the_client_could_not_hold_is_refused(tmp_path: Path, arena: dict[str, int]) -> None:
    """An arena beyond any the daemon grants (a count within a u32 once made the client build
    a list of every id: MemoryError escaped connect()), or past the last segment id (VAs
    beyond 64 bits), is a malformed hello."""
    fake = FakeDaemon(tmp_path, answering(lambda: fake.hello(arenas=[{"device": 0, "first_id": 1 << 10, "count": 16, "quota": 1 << 30, **arena}])))
    try:
        with pytest.raises(transfer.MalformedFrame, match="arenas"):
            connect(fake, ring=False)
    finally:
        fake.close()
