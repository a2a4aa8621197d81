"""NIXL loopback: two real processes on 127.0.0.1, metadata over a Pipe.

The test process is the server (initiator of one-sided READs and WRITEs); a
spawned producer registers buffers. Needs NIXL (``pip install --no-deps
nixl-cu12``); skipped otherwise. See docs/rdma.md.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from transfer.transport import _nixl

# The PyPI wheel installs the module ``nixl_cu12`` (the ``nixl`` name comes
# from a meta package that also drags in nixl-cu13), so rather than
# ``importorskip("nixl")`` ask the wrapper, which tries every name.
if not _nixl.available():
    pytest.skip("NIXL not installed (pip install --no-deps nixl-cu12)", allow_module_level=True)

from _nixl_peer import pattern, producer_main  # noqa: E402  (tests/integration/rdma is on sys.path)

from transfer.transport._nixl import (  # noqa: E402
    NixlEndpoint,
    NotRegistered,
    PeerDisconnected,
    RemoteRangeError,
    TransferFailed,
    TransferTimeout,
    check_ranges_within,
    decode_descs,
)

pytestmark = [pytest.mark.rdma, pytest.mark.timeout(30)]

DECLARED = 4 << 20
SECRET = 64 << 10
SEED = 1234
CTX = mp.get_context("spawn")


class Peer:
    """A producer process and the pipe to it."""

    def __init__(self, name: str, declared: int = DECLARED, env: dict[str, str] | None = None) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(
            target=producer_main, args=(child, name, declared, SECRET, SEED, env or {}), daemon=True
        )
        self.proc.start()
        child.close()
        hello = self.recv(timeout=20)
        self.pid: int = hello["pid"]
        self.metadata: bytes = hello["metadata"]
        self.descs = decode_descs(hello["descs"])  # untrusted bytes -> validated ranges
        self.base = int(self.descs.ranges[0, 0])
        self.secret_addr: int = hello["secret_addr"]

    def recv(self, timeout: float = 5.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("producer did not answer")
        return self.conn.recv()

    def call(self, *cmd: Any, timeout: float = 5.0) -> Any:
        self.conn.send(cmd)
        return self.recv(timeout)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("quit")
            except (OSError, EOFError, TimeoutError):
                pass
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer("producer-main")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def server(peer: Peer) -> Iterator[tuple[NixlEndpoint, str, np.ndarray, Any]]:
    ep = NixlEndpoint("server-main")
    name = ep.add_peer(peer.metadata, expected_name="producer-main")
    peer.call("add_peer", ep.metadata)  # lets the producer see our notifications by name
    local = np.zeros(DECLARED, np.uint8)
    reg = ep.register(local)
    yield ep, name, local, reg
    ep.close()


def test_metadata_and_descriptors(peer: Peer, server: Any) -> None:
    ep, name, _, _ = server
    assert name == "producer-main" and name in ep.peers
    assert peer.descs.mem_type == "DRAM" and len(peer.descs) == 1
    assert int(peer.descs.ranges[0, 1]) == DECLARED
    assert _nixl.peek_agent_name(peer.metadata) == "producer-main"
    with pytest.raises(_nixl.NixlError, match="already loaded"):
        ep.add_peer(peer.metadata)  # a second load would silently merge/overwrite


def test_read_whole_region_checksum(peer: Peer, server: Any) -> None:
    ep, name, local, reg = server
    local[:] = 0
    check_ranges_within(peer.descs.ranges, [(peer.base, DECLARED)])
    with ep.read(name, [(reg.addr, DECLARED)], [(peer.base, DECLARED)]) as x:
        x.wait(5)
        assert x.done and x.nbytes == DECLARED and x.count == 1
    assert zlib.crc32(local) == peer.call("crc", 0, DECLARED)
    assert np.array_equal(local, pattern(DECLARED, SEED))


def test_write_then_peer_checksum_and_notif(peer: Peer, server: Any) -> None:
    ep, name, local, reg = server
    off, n = 1 << 20, 256 << 10
    local[:n] = np.arange(n, dtype=np.uint32).view(np.uint8)[:n]
    with ep.write(name, [(reg.addr, n)], [(peer.base + off, n)], notif=b"wrote-1") as x:
        x.wait(5)
    assert peer.call("crc", off, n) == zlib.crc32(local[:n])
    deadline = time.monotonic() + 5
    seen: list[bytes] = []
    while time.monotonic() < deadline and b"wrote-1" not in seen:
        seen += peer.call("notifs").get("server-main", [])
    assert b"wrote-1" in seen
    # restore the producer's pattern for the other tests
    want = pattern(DECLARED, SEED)
    local[:n] = want[off : off + n]
    ep.write(name, [(reg.addr, n)], [(peer.base + off, n)]).wait(5)
    assert peer.call("crc", 0, DECLARED) == zlib.crc32(want)


def test_a_prepared_read_posted_again_reads_what_is_there_then(peer: Peer, server: Any) -> None:
    """`prepare` once, `post_prepared` again and again: one NIXL request, made at the first
    post, and each post moves the bytes as they are at that post."""
    ep, name, local, reg = server
    off, n = 2 << 20, 64 << 10
    read = ep.prepare("READ", name, np.array([[reg.addr, n, 0]], np.uint64), np.array([[peer.base + off, n, 0]], np.uint64))
    assert read.handle is None  # nothing asked of NIXL yet
    handles = []
    for k in (1, 2, 3):
        local[n : 2 * n] = k  # new bytes on the peer first (a WRITE from the other half)
        ep.write(name, [(reg.addr + n, n)], [(peer.base + off, n)]).wait(5)
        x = ep.post_prepared(read, n)
        x.wait(5)
        with pytest.raises(_nixl.NixlError, match="once at a time"):
            ep.post_prepared(read, n)  # not while a posting of it is out
        x.release()
        assert (local[:n] == k).all() and x.nbytes == n
        handles.append(read.handle)
    assert handles[0] is not None and all(h is handles[0] for h in handles)
    with pytest.raises(_nixl.InvalidField):
        ep.prepare("MOVE", name, read.local, read.remote)
    want = pattern(DECLARED, SEED)  # the producer's pattern back, for the other tests
    local[:n] = want[off : off + n]
    ep.write(name, [(reg.addr, n)], [(peer.base + off, n)]).wait(5)
    assert peer.call("crc", 0, DECLARED) == zlib.crc32(want)


def test_batch_of_1000_small_reads_is_one_transfer(peer: Peer, server: Any) -> None:
    ep, name, local, reg = server
    local[:] = 0
    rng = np.random.default_rng(7)
    size = 1024
    src_off = rng.choice(DECLARED // size, 1000, replace=False).astype(np.uint64) * size
    dst_off = np.arange(1000, dtype=np.uint64) * size
    lens = np.full(1000, size, np.uint64)
    remote = np.stack([peer.base + src_off, lens], axis=1)
    check_ranges_within(peer.descs.ranges, remote)
    t0 = time.perf_counter()
    x = ep.read(name, np.stack([reg.addr + dst_off, lens], axis=1), remote)
    x.wait(5)
    elapsed = time.perf_counter() - t0
    x.release()
    assert x.count == 1000 and x.nbytes == 1000 * size
    want = pattern(DECLARED, SEED)
    got = local[: 1000 * size].reshape(1000, size)
    for i in (0, 1, 499, 998, 999):
        o = int(src_off[i])
        assert np.array_equal(got[i], want[o : o + size])
    assert np.array_equal(got, want.reshape(-1, size)[(src_off // size).astype(np.int64)])
    assert elapsed < 2.0


def test_forged_ranges_refused(peer: Peer, server: Any) -> None:
    ep, name, local, reg = server
    declared = peer.descs.ranges
    forged = {
        "past the end": (peer.base + DECLARED - 8, 16),
        "before the start": (peer.base - 64, 64),
        "registered but never declared": (peer.secret_addr, 4096),
        "far away": (peer.base + (1 << 40), 64),
        "null": (0, 64),
    }
    for what, rng in forged.items():
        with pytest.raises(RemoteRangeError):
            check_ranges_within(declared, [(peer.base, 8), rng])
    # What NIXL itself does: it checks remote descriptors only against *all*
    # of the peer's registrations (from its metadata), on our side, when the
    # request is created. Unregistered addresses are refused ...
    for what in ("past the end", "before the start", "far away", "null"):
        addr, n = forged[what]
        with pytest.raises(NotRegistered):
            ep.read(name, [(reg.addr, n)], [(addr, n)])
    # ... but a range in another registration of the same peer is read
    # happily: NIXL cannot know what the peer meant to share with *this*
    # session. Hence check_ranges_within against the declared ranges.
    local[:4096] = 0
    with ep.read(name, [(reg.addr, 4096)], [(peer.secret_addr, 4096)]) as x:
        x.wait(5)
    assert np.array_equal(local[:4096], pattern(SECRET, SEED + 1)[:4096])
    # Local ranges outside our registrations are refused too.
    with pytest.raises(NotRegistered):
        ep.read(name, [(reg.addr + DECLARED - 8, 16)], [(peer.base, 16)])


def test_mismatched_and_empty_lists_refused(peer: Peer, server: Any) -> None:
    ep, name, _, reg = server
    with pytest.raises(_nixl.InvalidField):
        ep.read(name, [(reg.addr, 16)], [(peer.base, 32)])
    with pytest.raises(_nixl.InvalidField):
        ep.read(name, [(reg.addr, 16)], [])
    with pytest.raises(_nixl.NixlError, match="unknown peer"):
        ep.read("nobody", [(reg.addr, 16)], [(peer.base, 16)])


def _read_until_error(ep: NixlEndpoint, name: str, loc: np.ndarray, rem: np.ndarray, limit: float) -> Exception:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with ep.read(name, loc, rem) as x:
                x.wait(2)
        except (TransferFailed, TransferTimeout) as exc:
            return exc
    raise AssertionError("reads from a killed peer kept succeeding")


def test_peer_killed_mid_transfer() -> None:
    n = 64 << 20
    victim = Peer("producer-victim", declared=n)
    ep = NixlEndpoint("server-kill")
    try:
        name = ep.add_peer(victim.metadata)
        dst = np.zeros(n, np.uint8)
        reg = ep.register(dst)
        chunk = 64 << 10
        k = n // chunk
        offs = np.arange(k, dtype=np.uint64) * chunk
        lens = np.full(k, chunk, np.uint64)
        loc = np.stack([reg.addr + offs, lens], axis=1)
        rem = np.stack([victim.base + offs, lens], axis=1)
        with ep.read(name, loc, rem) as x:  # wire-up, and proof it worked
            x.wait(5)
        # Kill while a stream of 64 MiB reads (1,024 descriptors each) runs.
        killer = threading.Timer(0.05, os.kill, (victim.pid, signal.SIGKILL))
        t0 = time.monotonic()
        killer.start()
        err = _read_until_error(ep, name, loc, rem, limit=5.0)
        took = time.monotonic() - t0
        killer.join()
        assert isinstance(err, PeerDisconnected), err
        assert "producer-victim" in str(err)
        assert took < 3.0
        # Later transfers fail at once too; removing the peer works.
        with pytest.raises(PeerDisconnected):
            ep.read(name, loc[:1], rem[:1]).wait(2)
        ep.remove_peer(name)
        assert name not in ep.peers
    finally:
        ep.close()
        victim.stop()


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until every thread of `pid` is in the stopped state ('T' in /proc/PID/task/*/stat)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue
        if states and all(s in ("T", "t") for s in states):
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} did not stop within {timeout}s")


def test_stopped_peer_times_out_over_tcp() -> None:
    """Over tcp (UCX's software RMA: the target's progress thread serves
    reads), a peer that is alive but stopped makes wait() time out, cleanly."""
    env = {"UCX_TLS": "tcp"}
    old = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = "tcp"  # read by UCX when the agent is created
    try:
        victim = Peer("producer-stopped", declared=1 << 20, env=env)
        ep = NixlEndpoint("server-tcp")
    finally:
        if old is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = old
    try:
        name = ep.add_peer(victim.metadata)
        dst = np.zeros(1 << 20, np.uint8)
        reg = ep.register(dst)
        with ep.read(name, [(reg.addr, 1 << 20)], [(victim.base, 1 << 20)]) as x:
            x.wait(5)
        assert np.array_equal(dst, pattern(1 << 20, SEED))
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            _wait_stopped(victim.pid)  # kill() returns before every thread (UCX's progress thread) has stopped
            x = ep.read(name, [(reg.addr, 1 << 20)], [(victim.base, 1 << 20)])
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout):
                x.wait(0.5)
            assert 0.4 < time.monotonic() - t0 < 2.0
            assert not x.done
        finally:
            os.kill(victim.pid, signal.SIGKILL)
        # Once the peer is really gone, the stuck transfer fails, not hangs.
        with pytest.raises(PeerDisconnected):
            x.wait(5)
        x.release()
    finally:
        ep.close()
        victim.stop()
