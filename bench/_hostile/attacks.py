"""The attacks. Each runs in its own (spawned) process for one bounded episode.

An attack is `fn(ctx, tally, rng)`: it loops until `ctx.deadline` (wall clock) or its
own iteration bound, counts what it did in `tally` (requests sent, error classes
received, defended attempts, violations), and returns. Every attack stays on this
machine: the daemon's private ipc endpoint, its fd socket and shm dir, its metrics
port on 127.0.0.1, or (fake_daemon) a fake daemon of the attacker's own.

A *violation* (`VIOLATION:*` counts, with a note) is a request the daemon should have
refused but served (a forged VA that reached another session's memory, say), a defence
that did not hold (a request left unanswered, a connection held past its deadline, a
squatted name written to), or, against the fake daemon, a client that raised something
other than TransferError or OSError.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import random
import re
import resource
import selectors
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import msgspec
import numpy as np
import zmq

import transfer
from transfer import errors as E
from transfer import protocol as P
from transfer._fields import PID_MAX
from transfer.ring import Op as RingOp
from transfer.addressing import OFFSET_BITS
from transfer.server._metrics_http import DEFAULT_MAX_CONNECTIONS as METRICS_CAP
from transfer.server._metrics_http import DEFAULT_TIMEOUT_S as METRICS_TIMEOUT_S
from transfer.transport._fds import TOKEN_BYTES, fetch_fd, peer_credentials

from .fake_daemon import FakeDaemon, draw_breakage, hello_edges
from .tally import Tally, code_name

REPLY_LIMITS = P.Limits(max_frame_bytes=1 << 30, max_bin=1 << 30, max_str=1 << 20)
U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Ctx:
    endpoint: str
    shm_dir: str
    daemon_pid: int
    deadline: float  # wall clock: the episode ends by itself here
    timeout: float = 5.0  # per awaited request
    metrics_port: int = 0  # the daemon's metrics endpoint on 127.0.0.1 (0: it has none)

    def left(self) -> bool:
        return time.time() < self.deadline


def _daemon_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _alive_after(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end and _daemon_alive(pid):
        time.sleep(0.05)
    return _daemon_alive(pid)


# --- a raw DEALER ----------------------------------------------------------------------------
class Raw:
    def __init__(self, ctx: Ctx, *, sndhwm: int = 1000) -> None:
        zctx = zmq.Context.instance()
        zctx.MAX_SOCKETS = 8192
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        self.sock.connect(ctx.endpoint)
        self.next_id = 1

    def ids(self) -> int:
        self.next_id += 1
        return self.next_id

    def send(self, parts: list[bytes], tally: Tally) -> bool:
        try:
            self.sock.send_multipart(parts, zmq.NOBLOCK)
        except zmq.Again:
            tally.inc("send_eagain")
            return False
        tally.inc("frames_sent")
        return True

    def drain(self, tally: Tally, wait: float) -> int:
        """Receive what is there (waiting up to `wait` for the first); count reply codes."""
        n = 0
        while self.sock.poll(int(wait * 1000)):
            wait = 0.0
            parts = self.sock.recv_multipart()
            n += 1
            try:
                for r in P.decode_replies(parts[-1], REPLY_LIMITS):
                    tally.inc(f"reply:{code_name(r.error.code) if r.error else 'ok'}")
                    if r.error is not None and r.error.code == E.InternalError.code:
                        tally.note(f"InternalError: {r.error}"[:300])
            except E.TransferError as exc:
                tally.inc("undecodable_reply")
                tally.note(f"daemon sent an undecodable reply: {exc}"[:300])
        return n

    def call(self, req: P.Request, tally: Tally, timeout: float = 5.0) -> P.Reply | None:
        self.sock.send(P.encode_requests([req]))
        tally.inc("frames_sent")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self.sock.poll(100):
                continue
            for r in P.decode_replies(self.sock.recv_multipart()[-1], REPLY_LIMITS):
                if r.id == req.id:
                    return r
        tally.inc("call_timeout")
        return None

    def hello(self, tally: Tally) -> dict[str, Any] | None:
        r = self.call(P.Hello(self.ids(), P.VERSION, "hostile", os.getpid(), b""), tally)
        return r.result if r is not None and r.error is None else None

    def close(self) -> None:
        self.sock.close(0)


# --- 1. malformed / fuzzed frames --------------------------------------------------------------
def _random_request(rng: random.Random, vas: list[int]) -> list[Any]:
    va = lambda: rng.choice(vas + [0, U64, 1 << 63, rng.getrandbits(64)])
    small = lambda: rng.choice([0, 1, 8, 4096, 70_000, U64, rng.getrandbits(64)])
    rid = rng.randint(1, U64 - 1)
    return rng.choice([
        lambda: [20, rid, va(), va(), small(), rng.randint(0, 3)],
        lambda: [22, rid, va(), small(), rng.randint(0, 255), 0],
        lambda: [23, rid, va(), small(), 0],
        lambda: [21, rid, os.urandom(8 * rng.randint(0, 4)), os.urandom(8 * rng.randint(0, 4)), os.urandom(8 * rng.randint(0, 4)), 0],
        lambda: [10, rid, rng.choice([0, 1, 4096, U64])],
        lambda: [12, rid, rng.choice([0, 1, 4096, U64]), rng.randint(-2, 3)],
        lambda: [rng.choice([11, 13]), rid, va()],
        lambda: [rng.choice([2, 3, 30, 40]), rid],
        lambda: [1, rid, rng.randint(0, 3), "x" * rng.randint(0, 300), 0, b""],
        lambda: [rng.choice([0, 5, 99, 255, 65536, -1]), rid],  # unknown ops
        lambda: [24, rid, "sum", [[va(), "float32", [1 << 39, 1 << 39], [0, 0]]], [], {}, -1, "", 0],
    ])()


def _bad_field(rng: random.Random) -> Any:
    return rng.choice([None, True, 1.5, float("nan"), "str", b"bin", [], {}, -1, U64, -(1 << 63), [[[]]]])


def fuzz_frame(rng: random.Random, vas: list[int]) -> tuple[str, list[bytes]]:
    kind = rng.choice(["bytes", "truncated", "mutated", "version", "huge_count", "unknown_op", "field_types", "nesting", "multipart", "ext", "oversize"])
    reqs = [_random_request(rng, vas) for _ in range(rng.randint(1, 6))]
    valid = msgpack.packb([P.VERSION, reqs], use_bin_type=True)
    if kind == "bytes":
        return kind, [os.urandom(rng.randint(0, 300))]
    if kind == "truncated":
        return kind, [valid[: rng.randint(0, max(0, len(valid) - 1))]]
    if kind == "mutated":
        b = bytearray(valid)
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return kind, [bytes(b)]
    if kind == "version":
        return kind, [msgpack.packb([rng.choice([0, 2, -1, 1 << 40, "1", None, True, 1.0]), reqs], use_bin_type=True)]
    if kind == "huge_count":  # headers that claim billions of elements / bytes
        return kind, [rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\x92\x01\xdd\xff\xff\xff\xff",
                                  b"\x92\x01\x91\xdd\x7f\xff\xff\xff" + b"\x14" * 64])]
    if kind == "unknown_op":
        return kind, [msgpack.packb([1, [[rng.choice([0, 5, 6, 19, 99, 127, 128, 255, 1 << 20]), rng.randint(1, 1 << 32)]]])]
    if kind == "field_types":
        r = _random_request(rng, vas)
        for i in range(rng.randint(1, 3)):
            r[rng.randrange(len(r))] = _bad_field(rng)
        return kind, [msgpack.packb([1, [r]], use_bin_type=True)]
    if kind == "nesting":
        return kind, [b"\x92\x01" + b"\x91" * rng.choice([100, 2000, 50_000]) + b"\xc0"]
    if kind == "multipart":
        return kind, [valid] + [os.urandom(rng.randint(0, 16)) for _ in range(rng.randint(1, 3))]
    if kind == "ext":
        return kind, [rng.choice([b"\xd4\x01\x00", msgpack.packb([1, msgpack.ExtType(1, b"x")])])]
    # oversize: above max_frame_bytes (rarely: it costs both sides 4 MiB)
    if rng.random() < 0.05:
        return kind, [b"\x00" * ((4 << 20) + 1)]
    return kind, [msgpack.packb([1, [[3, i + 1] for i in range(70_000)]])]  # above max_batch


def attack_fuzz(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    for _ in range(200):
        if not ctx.left():
            return
        raw = Raw(ctx)
        try:
            vas = [0]
            if rng.random() < 0.6 and raw.hello(t) is not None:
                t.inc("sessions")
                r = raw.call(P.RegisterHost(raw.ids(), 1 << 16), t)
                if r is not None and r.error is None:
                    vas.append(r.result["va"])
            for _ in range(rng.randint(10, 100)):
                if not ctx.left():
                    break
                try:
                    kind, parts = fuzz_frame(rng, vas)
                except (OverflowError, ValueError, TypeError):
                    t.inc("unpackable")
                    continue
                t.inc(f"frame:{kind}")
                raw.send(parts, t)
                if raw.drain(t, 0.3) == 0:
                    t.inc("no_reply")
            if rng.random() < 0.5:
                raw.call(P.Close(raw.ids()), t, timeout=1.0)
        finally:
            raw.close()


# --- 2. forged and stale VAs -------------------------------------------------------------------
def attack_forged_va(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    with transfer.connect(ctx.endpoint, name="forger", ring=rng.random() < 0.5) as c:
        seg = c.segment(1 << 16)
        buf = c.alloc(1 << 16)
        c.fill(buf, 1 << 16, 0).result(ctx.timeout)  # materialize the deferred buffer
        stale = c.segment(4096)
        stale_va = stale.va
        c.free(stale)
        mine = {seg.va >> OFFSET_BITS, buf.va >> OFFSET_BITS}
        top = max(mine) + 64
        for i in range(20_000):
            if not ctx.left():
                return
            what = rng.choice(["foreign", "foreign", "stale", "oob", "overflow", "unknown"])
            if what == "foreign":
                sid = rng.randint(1, top)
                if sid in mine:
                    continue
                va = (sid << OFFSET_BITS) + rng.choice([0, 0, 8, 4096, rng.randrange(1 << 20)])
                n = rng.choice([1, 8, 4096, 1 << 16])
            elif what == "stale":
                va, n = stale_va + rng.randrange(4096), rng.choice([1, 8, 64])
            elif what == "oob":
                off = rng.choice([0, 1 << 15, (1 << 16) - 1, 1 << 16])
                va, n = seg.va + off, (1 << 16) - off + rng.choice([1, 8, 1 << 20])
            elif what == "overflow":
                va, n = rng.choice([seg.va + 8, U64, U64 - 7, (1 << 63)]), rng.choice([U64, U64 - 7, 1 << 63])
            else:
                va, n = rng.choice([0, 1, (1 << 24) - 1 << OFFSET_BITS, rng.getrandbits(64)]), 8
            op = rng.choice(["read", "write", "fill", "checksum"])
            t.inc(f"try:{what}")
            try:
                if op == "read":
                    c.copy(seg.va, va, min(n, 1 << 16) if what == "foreign" else n).result(ctx.timeout)
                elif op == "write":
                    c.copy(va, seg.va, min(n, 1 << 16) if what == "foreign" else n).result(ctx.timeout)
                elif op == "fill":
                    c.fill(va, n, 0xEE).result(ctx.timeout)
                else:
                    c.checksum(va, n).result(ctx.timeout)
                if (va >> OFFSET_BITS) not in mine or what in ("stale", "oob", "overflow"):
                    t.inc(f"VIOLATION:{what}:{op}")
                    t.note(f"VIOLATION {op} {what} va={va:#x} n={n} was served")
                else:
                    t.inc("served_own")
            except E.TransferError as exc:
                t.error(exc)
                if isinstance(exc, E.ConnectionLost):
                    return


# --- 3. hello/close churn, connections that never say hello ------------------------------------
def attack_churn(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    for _ in range(2_000):
        if not ctx.left():
            return
        mode = rng.choice(["open_close", "open_close", "with_resources", "drop_without_close", "never_hello"])
        t.inc(f"mode:{mode}")
        try:
            if mode in ("open_close", "with_resources"):
                with transfer.connect(ctx.endpoint, name="churn", ring=rng.random() < 0.3, connect_timeout=ctx.timeout) as c:
                    if mode == "with_resources":
                        s = c.segment(4096)
                        b = c.alloc(4096)
                        c.copy(b, s).result(ctx.timeout)
                t.inc("sessions")
            elif mode == "drop_without_close":  # hello, then vanish: the daemon must reap it (heartbeat)
                raw = Raw(ctx)
                if raw.hello(t) is not None:
                    t.inc("sessions_dropped")
                    if rng.random() < 0.5:
                        raw.call(P.RegisterHost(raw.ids(), 4096), t)
                raw.close()
            else:  # silent connections: connect and say nothing, then go
                socks = [Raw(ctx) for _ in range(rng.randint(5, 50))]
                t.inc("silent_conns", len(socks))
                time.sleep(rng.uniform(0.1, 1.0))
                for s in socks:
                    s.close()
        except E.TransferError as exc:
            t.error(exc)


def attack_silent_flood(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    """Many connections at once that never say hello (each one an fd in the daemon)."""
    for _ in range(20):
        if not ctx.left():
            return
        socks = []
        for _ in range(rng.randint(300, 1200)):
            try:
                socks.append(Raw(ctx))
            except zmq.ZMQError as exc:
                t.inc(f"local:{zmq.strerror(exc.errno)}")
                break
        t.inc("silent_conns", len(socks))
        t.inc("bursts")
        # a few say something that is not hello (NoSession expected)
        for s in socks[:: max(1, len(socks) // 20)]:
            s.send([P.encode_requests([P.Ping(1)])], t)
        time.sleep(rng.uniform(1.0, 3.0))
        for s in socks:
            s.drain(t, 0.0)
            s.close()
        time.sleep(0.5)


# --- 4. send, never read replies ----------------------------------------------------------------
def attack_flood(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    for _ in range(20):
        if not ctx.left():
            return
        raw = Raw(ctx, sndhwm=100_000)
        try:
            raw.sock.setsockopt(zmq.RCVHWM, 10)  # we never read; let replies pile up on the daemon's side
            if raw.hello(t) is None:
                continue
            t.inc("sessions")
            r = raw.call(P.RegisterHost(raw.ids(), 1 << 16), t)
            va = r.result["va"] if r is not None and r.error is None else 0
            for _ in range(rng.randint(500, 5000)):
                if not ctx.left():
                    break
                kind = rng.choice(["stats", "ping", "copies", "copies"])
                if kind == "stats":
                    reqs: list[P.Request] = [P.Stats(raw.ids()) for _ in range(rng.randint(1, 200))]
                elif kind == "ping":
                    reqs = [P.Ping(raw.ids()) for _ in range(rng.randint(1, 500))]
                else:
                    reqs = [P.Copy(raw.ids(), va + 64 * (i % 512), va + 32768 + 64 * (i % 256), 64, 0) for i in range(rng.randint(100, 1000))]
                t.inc(f"requests:{kind}", len(reqs))
                raw.send([P.encode_requests(reqs)], t)
            time.sleep(rng.uniform(0.5, 2.0))  # hold the connection with replies unread
        finally:
            raw.close()


# --- 5. resource hogs -------------------------------------------------------------------------
def attack_hog(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    c = transfer.connect(ctx.endpoint, name="hog")
    g = transfer.connect(ctx.endpoint, name="guest")
    try:
        segs: list[Any] = []
        total = 0
        for _ in range(200):  # register until the quota says no (or 256 MiB: this machine is shared)
            if not ctx.left() or total > 256 << 20:
                break
            try:
                segs.append(c.segment(rng.choice([4096, 1 << 20, 4 << 20, 16 << 20])))
                total += segs[-1].nbytes
                t.inc("segments")
            except E.TransferError as exc:
                t.error(exc, "register")
                break
        total = 0
        for _ in range(200):  # device buffers until the quota says no (deferred: the first use tells)
            if not ctx.left() or total > 256 << 20:
                break
            try:
                b = c.alloc(rng.choice([4096, 1 << 20, 8 << 20]))
                total += b.nbytes
                c.fill(b, 8, 1).result(ctx.timeout)
                t.inc("buffers")
            except E.TransferError as exc:
                t.error(exc, "alloc")
                break
        for seg in segs[:8]:  # share, then misuse it as the guest
            if not ctx.left():
                break
            try:
                tok = c.share(seg)
                a = g.attach(tok)
                t.inc("attached")
                mine = g.segment(4096)
                g.copy(mine, a.va, 4096).result(ctx.timeout)
                for req in (P.Share, P.Unregister, P.Free):  # a guest may only detach
                    try:
                        g._call(req, a.va, timeout=ctx.timeout)
                        t.inc(f"guest_{req.__name__}:ok")
                    except E.TransferError as exc:
                        t.error(exc, f"guest_{req.__name__}")
                try:
                    g.copy(mine, a.va, 4096).result(ctx.timeout)
                    t.inc("guest_use_after_detach:ok")
                except E.TransferError as exc:
                    t.error(exc, "guest_use_after_detach")
                a2 = g.attach(tok)
                g.copy(mine, a2.va, 4096)  # in flight while the owner frees it
                c.free(seg)
                segs.remove(seg)
                try:
                    g.fence(timeout=ctx.timeout)
                except E.TransferError as exc:
                    t.error(exc, "guest_during_free")
                try:
                    g.copy(mine, a2.va, 4096).result(ctx.timeout)
                    t.inc("VIOLATION:guest_use_after_owner_free")
                    t.note(f"guest copied from {a2.va:#x} after its owner freed it")
                except E.TransferError as exc:
                    t.error(exc, "guest_after_owner_free")
                g.free(mine)
            except E.TransferError as exc:
                t.error(exc, "share")
        if rng.random() < 0.4:
            t.inc("exit_without_close")
            t.flush(done=True)
            os._exit(0)  # leave everything held: pidfd reclaim
    finally:
        for cl in (g, c):
            cl.close()


# --- 6. ring abuse ------------------------------------------------------------------------------
def attack_ring(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    for _ in range(50):
        if not ctx.left():
            return
        try:
            c = transfer.connect(ctx.endpoint, name="ringer", ring=rng.choice([True, 64, 4096]))
        except E.TransferError as exc:
            t.error(exc, "connect")
            time.sleep(0.2)
            continue
        try:
            seg = c.segment(4096)
            assert c._ring is not None
            ring = c._ring.ring
            pushed = 0
            for _ in range(rng.randint(1, 20)):
                descs = np.zeros(rng.randint(1, 512), ring.out_dtype)
                k = len(descs)
                descs["op"] = [rng.choice([RingOp.COPY, RingOp.FILL, RingOp.CHECKSUM, RingOp.FENCE, RingOp.NOP, RingOp.COMPUTE, 7, 99, 65535]) for _ in range(k)]
                descs["id"] = [rng.choice([0, rng.getrandbits(64), 1]) for _ in range(k)]
                pick = lambda seg=seg: rng.choice([seg.va + rng.randrange(4096), rng.getrandbits(64), rng.randint(1, 4096) << OFFSET_BITS, 0, U64])
                descs["dst"] = [pick() for _ in range(k)]
                descs["src"] = [pick() for _ in range(k)]
                descs["nbytes"] = [rng.choice([0, 8, 4096, 1 << 40, U64]) for _ in range(k)]
                descs["flags"] = [rng.choice([0, 0, 1, 2, 3, 4, 5, 0xFFFF]) for _ in range(k)]  # 2: FLAG_AFTER; 4: FLAG_SUM
                descs["arg2"] = [rng.choice([0, 0, 1, 3, 1 << 40, U64]) for _ in range(k)]  # (a fence: frames to wait for)
                descs["stream"] = [rng.choice([0, 1, 0xFFFFFFFF]) for _ in range(k)]
                descs["arg0"] = [rng.choice([0, 255, 256, U64]) for _ in range(k)]
                n = ring.push_many(descs)  # never pop the completions
                pushed += n
                if n < k:
                    t.inc("ring_full")
                    break
            t.inc("descriptors", pushed)
            os.write(c._ring.bell_fd, b"\0")
            time.sleep(rng.uniform(0.05, 0.5))
            if rng.random() < 0.4:  # corrupt an index (or the header), then ring the bell
                words = memoryview(ring._mm).cast("Q")
                which = rng.choice(["req_tail", "req_head", "cmp_head", "header"])
                off = {"req_tail": 128, "req_head": 256, "cmp_head": 640 + 128, "header": 8}[which]
                words[off // 8] = rng.choice([words[off // 8] + (1 << 40), U64, 0, rng.getrandbits(64)])
                words.release()
                os.write(c._ring.bell_fd, b"\0")
                t.inc(f"corrupt:{which}")
                time.sleep(0.3)
        except E.TransferError as exc:
            t.error(exc)
        except (OSError, ValueError) as exc:
            t.inc(f"local:{type(exc).__name__}")
        finally:
            if rng.random() < 0.3:
                t.inc("abandoned")  # the daemon reaps it when we exit
            else:
                try:
                    c.close()
                except Exception as exc:  # noqa: BLE001
                    t.error(exc, "close")


# --- 7. compute with hostile tensors -------------------------------------------------------------
def _compute(c: transfer.Client, ctx: Ctx, t: Tally, label: str, op: str, ins: list[Any], outs: list[Any], params: dict[str, Any] | None = None) -> None:
    t.inc(f"try:{label}")
    try:
        c.compute(op, ins, outs, params).result(ctx.timeout)
        t.inc(f"served:{label}")
    except E.TransferError as exc:
        t.error(exc, label)
        if isinstance(exc, E.ConnectionLost):
            raise


def attack_compute(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    """Unknown operators, mismatched shapes, bad params, too many dims, out-of-range tensors."""
    TR = transfer.TensorRef
    with transfer.connect(ctx.endpoint, name="computer") as c:
        seg = c.segment(1 << 16)
        v = seg.va
        cases: list[tuple[str, str, list[Any], list[Any], dict[str, Any] | None]] = [
            ("unknown_op", "no_such_op", [TR(v, "float32", (4,))], [TR(v + 64, "float32", (4,))], None),
            ("unknown_op2", "x" * 64, [], [], None),
            ("shape_mismatch", "cast", [TR(v, "float32", (4, 4))], [TR(v + 128, "float32", (2, 2))], None),
            ("matmul_mismatch", "matmul", [TR(v, "float32", (4, 3)), TR(v + 64, "float32", (4, 3))], [TR(v + 256, "float32", (4, 3))], None),
            ("too_many_dims", "sum", [TR(v, "uint8", (1,) * 9)], [TR(v + 64, "uint8", ())], None),
            ("huge_oob", "sum", [TR(v, "float32", (1 << 39, 1 << 39))], [TR(v + 64, "float32", ())], None),
            ("stride_oob", "sum", [TR(v, "float32", (16,), (1 << 30,))], [TR(v + 64, "float32", ())], None),
            ("foreign", "sum", [TR(1 << OFFSET_BITS, "float32", (4,))], [TR(v, "float32", ())], None),
            ("bad_params", "normalize", [TR(v, "uint8", (1, 3, 2, 2))], [TR(v + 64, "float32", (1, 3, 2, 2))], {"mean": [1], "std": [0, 0, 0]}),
            ("nan_param", "fill", [], [TR(v, "float32", (4,))], {"value": float("nan")}),
            ("bad_dtype", "sum", [TR(v, "float16", (4,))], [TR(v + 64, "float16", ())], None),
            ("overlap_out", "scale_add", [TR(v, "float32", (64,))], [TR(v + 4, "float32", (64,))], None),
        ]
        for _ in range(5_000):
            if not ctx.left():
                return
            _compute(c, ctx, t, *rng.choice(cases))


def attack_compute_zero_stride(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    """Huge dimensions with zero strides: a 4-byte extent that passes every bounds check,
    describing 2^60 elements. A daemon that runs it has to be bounded somewhere else."""
    TR = transfer.TensorRef
    with transfer.connect(ctx.endpoint, name="zero-stride", liveness_timeout=3 * ctx.timeout) as c:
        seg = c.segment(1 << 16)
        v = seg.va
        d = rng.choice([1 << 30, (1 << 40) - 1])
        cases = [
            ("cast", [TR(v, "float32", (d, d), (0, 0))], [TR(v + 64, "float32", (d, d), (0, 0))], None),
            ("sum", [TR(v, "float32", (d, d), (0, 0))], [TR(v + 64, "float32", ())], None),
            ("fill", [], [TR(v, "float32", (d, d), (0, 0))], {"value": 1.0}),
            ("checksum", [TR(v, "uint8", (d, d), (0, 0))], [], None),
        ]
        for _ in range(3):
            if not ctx.left():
                return
            op, ins, outs, params = rng.choice(cases)
            _compute(c, ctx, t, f"zero_stride_{op}", op, ins, outs, params)


# --- 8. truncating a segment's or ring's backing file -------------------------------------------
def _fds_for(name_part: str) -> list[int]:
    fds = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/memfd:") and name_part in target:
            fds.append(int(fd))
    return fds


def _map_files(name_part: str) -> list[int]:
    """Fds opened through /proc/self/map_files (root only): another route to a mapping's file.
    Only memfd mappings: a name part like "transfer" alone would match the package's own
    shared library, and truncating that would fault every process that maps it."""
    fds = []
    try:
        entries = os.listdir("/proc/self/map_files")
    except OSError:
        return fds
    for e in entries:
        try:
            if os.readlink(f"/proc/self/map_files/{e}").startswith(name_part):
                fds.append(os.open(f"/proc/self/map_files/{e}", os.O_RDWR))
        except OSError:
            continue
    return fds


def _describe_fd(fd: int) -> str:
    """What an fd is, for the notes: its target, size and seals."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        target = "?"
    try:
        seals = fcntl.fcntl(fd, 1034)  # F_GET_SEALS
    except OSError:
        seals = -1
    try:
        size = os.fstat(fd).st_size
    except OSError:
        size = -1
    return f"{target}, {size} bytes, seals {seals}"


def _truncate(t: Tally, label: str, fds: list[int], path: str | None) -> bool:
    """Try every handle the client API left us; True if one truncation succeeded."""
    tried = False
    for fd in fds:
        tried = True
        try:
            what = _describe_fd(fd)
            os.ftruncate(fd, 0)
            t.inc(f"{label}:truncated_fd")
            t.note(f"{label}: truncated fd {fd} ({what})")
            return True
        except OSError as exc:
            t.inc(f"{label}:defended_fd:{errno.errorcode.get(exc.errno, exc.errno)}")
    if path is not None:
        tried = True
        try:
            os.truncate(path, 0)
            t.inc(f"{label}:truncated_path")
            return True
        except OSError as exc:
            t.inc(f"{label}:defended_path:{errno.errorcode.get(exc.errno, exc.errno)}")
    if not tried:
        t.inc(f"{label}:defended_no_handle")
    return False


def attack_truncate_segment(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    with transfer.connect(ctx.endpoint, name="truncator", ring=rng.random() < 0.5) as c:
        buf = c.alloc(1 << 20)
        for _ in range(5):
            if not ctx.left() or not _daemon_alive(ctx.daemon_pid):
                return
            if rng.random() < 0.5:  # the mapped segment, through any fd or mapping of it we can reach
                seg = c.segment(1 << 20)
                opened = _map_files("/memfd:transfer")
                try:
                    done = _truncate(t, "mapped", _fds_for("memfd:transfer") + opened, None)
                finally:
                    for fd in opened:
                        os.close(fd)
                va = seg.va
            else:  # the memfd the daemon hands out, collected by hand from the fd socket
                info = c._call(P.RegisterHost, 1 << 20, timeout=ctx.timeout)  # a Registered: no path, a token
                fds = [c._core.collect(info.token)]
                try:
                    done = _truncate(t, "handed_out", fds, None)
                finally:
                    for fd in fds:
                        os.close(fd)
                va = info.va
            if done:
                t.note(f"truncated segment {va:#x}; now asking the daemon to read it")
            try:
                c.copy(buf, va, 1 << 20).result(ctx.timeout)
                t.inc("copy_after_truncate:served")
            except E.TransferError as exc:
                t.error(exc, "copy_after_truncate")
                if isinstance(exc, E.ConnectionLost):
                    t.note(f"daemon alive 2 s after the truncation: {_alive_after(ctx.daemon_pid, 2.0)}")
                    return
            time.sleep(0.5)


def attack_truncate_ring(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    with transfer.connect(ctx.endpoint, name="ring-truncator", ring=True) as c:
        seg = c.segment(4096)
        assert c._ring is not None
        ring = c._ring.ring
        path = getattr(ring, "path", None)
        opened = _map_files("/memfd:transfer")
        try:
            done = _truncate(t, "ring", (_fds_for(Path(path).name) if path else []) + _fds_for("memfd:transfer") + opened, None)
        finally:
            for fd in opened:
                os.close(fd)
        if done:
            t.note("truncated the ring's file; now pushing a descriptor")
        try:
            c.copy(seg.at(0), seg.at(64), 8).result(ctx.timeout)
            t.inc("ring_copy_after_truncate:served")
        except E.TransferError as exc:
            t.error(exc, "ring_copy_after_truncate")
        except (OSError, ValueError) as exc:  # our own mapping is gone too (SIGBUS would kill us first)
            t.inc(f"local:{type(exc).__name__}")
        if done:
            t.note(f"daemon alive 2 s after the ring truncation: {_alive_after(ctx.daemon_pid, 2.0)}")


# --- 9. a client killed mid-request (the orchestrator SIGKILLs this one early) ------------------
def attack_midkill(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    c = transfer.connect(ctx.endpoint, name="midkill", ring=rng.random() < 0.5)
    t.inc("sessions")
    t.flush(force=True)
    seg = c.segment(8 << 20)
    buf = c.alloc(8 << 20)
    for i in range(100_000):
        if not ctx.left():
            break
        n = rng.choice([64, 4096, 1 << 20, 8 << 20])
        c.copy(buf, seg, n)
        if i % 3 == 0:
            k = rng.randint(16, 4096)
            offs = np.arange(k, dtype=np.uint64) * 64
            c.copy_many(buf.va + offs, seg.va + offs, np.full(k, 64, np.uint64))
        if i % 5 == 0:
            s2 = c.segment(1 << 20)  # resources created and left behind for the reaper
            c.copy(s2, buf, 1 << 20)
        t.inc("requests", 1 + (i % 3 == 0))
        if i % 16 == 15:
            c.checksum(buf, n)  # pending, never waited on
            c.fence(timeout=ctx.timeout)
    c.close()


# --- 10. every integer field at its declared extremes; hellos that claim any pid ----------------
#: Where integer widths change: a u32 reaching a C int, a u64 reaching an int64.
WIDTH_EDGES = ((1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63)
I64_MIN = -(1 << 63)


@dataclass(frozen=True)
class Probe:
    """One request with one integer field (`pos` among the fields after the id; -1: the id) at `value`."""

    cls: type[P.Request]
    field: str
    pos: int
    value: int
    lo: int
    hi: int

    @property
    def in_range(self) -> bool:
        return self.lo <= self.value <= self.hi

    def __str__(self) -> str:
        return f"{self.cls.__name__}.{self.field}={self.value}"


def _extremes(lo: int, hi: int) -> list[int]:
    """A field's declared ends, one step past each, and the width edges between: what msgpack carries."""
    vals = {lo, hi, lo - 1, hi + 1, *(v for v in WIDTH_EDGES if lo <= v <= hi)}
    return sorted(v for v in vals if I64_MIN <= v <= U64)


def _probes(ctx: Ctx) -> list[Probe]:
    """Hellos with every pid worth claiming (Pid's ends and past them, C widths, live processes
    not ours), then every request's integer fields (`protocol.int_bounds`) at their extremes."""
    pids = {0, 1, PID_MAX, PID_MAX + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, U64, -1, ctx.daemon_pid, os.getppid(), os.getpid()}
    out = [Probe(P.Hello, "pid", 2, v, 0, PID_MAX) for v in sorted(pids)]
    for cls in P.REQUEST_TYPES.values():
        for pos, name, lo, hi in P.int_bounds(cls):
            if (cls, name) != (P.Hello, "pid"):
                out += [Probe(cls, name, pos, v, lo, hi) for v in _extremes(lo, hi)]
    out += [Probe(P.Ping, "id", -1, v, 1, U64) for v in (1, (1 << 63) - 1, 1 << 63, U64)]
    return out


def _baseline(cls: type[P.Request], vas: dict[str, int]) -> list[Any]:
    """A request's fields, each plausible on its own (defaults, the session's VAs for fields that
    name memory, empty containers), so a probe gets past decoding to the checks behind it."""
    I = msgspec.inspect
    info = I.type_info(cls)
    assert isinstance(info, I.StructType)
    out: list[Any] = []
    for f in info.fields[1:]:
        if not f.required:
            out.append(f.default)
        elif f.name == "params":
            out.append({})
        elif isinstance(f.type, I.IntType):
            out.append(vas.get(f.name, 64 if f.name == "nbytes" else 1))
        elif isinstance(f.type, I.StrType):
            out.append("sum" if f.name == "op" else "")
        elif isinstance(f.type, (I.BytesType, I.CustomType)):
            out.append(b"")
        elif isinstance(f.type, I.ListType):
            out.append([])
        else:
            out.append(None)
    return out


def _ask(raw: Raw, t: Tally, op: int, rid: int, fields: list[Any], timeout: float) -> P.Reply | None:
    """One request in a frame of its own; its reply (or the frame's, id 0), or None if none came."""
    try:
        raw.sock.send(msgpack.packb([P.VERSION, [[op, rid, *fields]]], use_bin_type=True), zmq.NOBLOCK)
    except zmq.ZMQError:
        t.inc("send_failed")
        return None
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        if not raw.sock.poll(int(left * 1000) + 1):
            break
        try:
            replies = P.decode_replies(raw.sock.recv_multipart()[-1], REPLY_LIMITS)
        except E.TransferError as exc:
            t.inc("undecodable_reply")
            t.note(f"daemon sent an undecodable reply: {exc}"[:300])
            continue
        for r in replies:
            if r.id in (rid, 0):
                return r
    return None


def _open_raw_session(ctx: Ctx, t: Tally, pid: int) -> tuple[Raw, dict[str, Any]] | None:
    """A raw session claiming `pid`, with a segment and a buffer whose VAs the probes use."""
    raw = Raw(ctx)
    r = _ask(raw, t, P.Hello.OP, raw.ids(), [P.VERSION, "extremes", pid, b""], ctx.timeout)
    if r is None or r.error is not None:
        t.inc(f"session:{'unanswered' if r is None else type(r.error).__name__}")
        raw.close()
        return None
    vas: dict[str, Any] = {"fd_socket": r.result.get("fd_socket")}
    r = _ask(raw, t, P.RegisterHost.OP, raw.ids(), [64 << 10], ctx.timeout)
    if r is not None and r.error is None:
        vas["va"] = vas["src"] = vas["graph"] = r.result["va"]
        vas["dst"] = r.result["va"] + 4096
    r = _ask(raw, t, P.Alloc.OP, raw.ids(), [64 << 10, -1], ctx.timeout)
    if r is not None and r.error is None:
        vas["dst"] = r.result["va"]
    return raw, vas


def _close_raw(raw: Raw, t: Tally) -> None:
    _ask(raw, t, P.Close.OP, raw.ids(), [], 2.0)
    raw.close()


def _judge(t: Tally, pr: Probe, r: P.Reply) -> None:
    """Out of range: refused. In range: served or refused by a check, never an InternalError."""
    if r.id == 0 and pr.field != "id":
        t.inc("answered_as_frame_error")
    if r.error is None:
        if pr.in_range:
            t.inc("in_range:ok")
        else:
            t.inc(f"VIOLATION:out_of_range_served:{pr.cls.__name__}.{pr.field}")
            t.note(f"VIOLATION {pr} is outside [{pr.lo}, {pr.hi}] and was served")
        return
    t.inc(f"{'in' if pr.in_range else 'out_of'}_range:{type(r.error).__name__}")
    if isinstance(r.error, E.InternalError):
        t.inc("VIOLATION:internal_error")
        t.note(f"VIOLATION {pr} was answered InternalError: {r.error}"[:300])


def _check_token_owner(ctx: Ctx, t: Tally, raw: Raw, claimed: int, fd_socket: Any) -> None:
    """A session that claimed another process's pid: its memfds go to that process, never to us."""
    r = _ask(raw, t, P.RegisterHost.OP, raw.ids(), [4096], ctx.timeout)
    if r is None or r.error is not None or not isinstance(fd_socket, str):
        t.inc("token_check:no_segment")
        return
    ours = claimed in (0, os.getpid())  # pid 0: the session named no process, so none is checked
    try:
        fd = fetch_fd(fd_socket, r.result["token"], timeout=ctx.timeout)
    except E.ProtocolError:
        t.inc("token:own_refused" if ours else "token:foreign_refused")
        if ours:
            t.note(f"a session claiming pid {claimed} could not collect its own segment")
        return
    except E.TransferError as exc:
        t.error(exc, "token")
        return
    os.close(fd)
    if ours:
        t.inc("token:own_collected")
    else:
        t.inc("VIOLATION:token_served_to_another_process")
        t.note(f"VIOLATION a session claiming pid {claimed} had its memfd handed to pid {os.getpid()}")


def _probe_hello(ctx: Ctx, t: Tally, pr: Probe) -> None:
    """Hellos open sessions: each on a connection of its own (asked twice before it counts as unanswered)."""
    fields = _baseline(P.Hello, {})
    fields[pr.pos] = pr.value
    for attempt in range(2):
        raw = Raw(ctx)
        try:
            r = _ask(raw, t, P.Hello.OP, raw.ids(), fields, ctx.timeout)
            if r is None:
                continue
            _judge(t, pr, r)
            if r.error is None:
                t.inc("sessions")
                if pr.field == "pid":
                    _check_token_owner(ctx, t, raw, pr.value, r.result.get("fd_socket"))
                _ask(raw, t, P.Close.OP, raw.ids(), [], 2.0)
            return
        finally:
            raw.close()
    t.inc("VIOLATION:unanswered")
    t.note(f"VIOLATION {pr}: no reply, twice")


def attack_pid_extremes(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    """Every probe of `_probes`, in a random order, up to three times over: each answered, none
    out of range served, none answered InternalError, no memfd handed to a pid not the session's."""
    probes = _probes(ctx) * 3
    rng.shuffle(probes)
    sess: tuple[Raw, dict[str, Any]] | None = None
    try:
        for pr in probes:
            if not ctx.left():
                return
            t.inc("probes")
            if pr.cls is P.Hello:
                _probe_hello(ctx, t, pr)
                continue
            for attempt in range(2):  # a probe that ended its session (or found it reaped) is asked again on a new one
                if sess is None:
                    sess = _open_raw_session(ctx, t, os.getpid())
                    if sess is None:
                        break
                raw, vas = sess
                fields = _baseline(pr.cls, vas)
                rid = raw.ids()
                if pr.pos < 0:
                    rid = pr.value
                else:
                    fields[pr.pos] = pr.value
                r = _ask(raw, t, pr.cls.OP, rid, fields, ctx.timeout)
                if r is not None and not isinstance(r.error, (E.NoSession, E.SessionClosed)):
                    _judge(t, pr, r)
                    break
                t.inc("session_lost" if r is not None else "unanswered_once")
                raw.close()
                sess = None
                if attempt == 1 and r is None:
                    t.inc("VIOLATION:unanswered")
                    t.note(f"VIOLATION {pr}: no reply, twice")
    finally:
        if sess is not None:
            _close_raw(sess[0], t)


# --- 11. silent and garbage peers of the fd socket -----------------------------------------------
_FDS_NAME = re.compile(r"transfer\.[0-9a-f]+\.fds\.[0-9a-f]+")


def _daemon_fd_socket(ctx: Ctx) -> str | None:
    """The daemon's fd socket: a socket named `transfer.<instance>.fds.<random>` whose listener
    is the daemon (a squatter may have put sockets of its own in the dir)."""
    for name in sorted(os.listdir(ctx.shm_dir)):
        path = os.path.join(ctx.shm_dir, name)
        try:
            if not (_FDS_NAME.fullmatch(name) and stat.S_ISSOCK(os.lstat(path).st_mode)):
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.settimeout(1.0)
                s.connect(path)
                if peer_credentials(s)[0] == ctx.daemon_pid:
                    return path
        except OSError:
            continue
    return None


def _garbage_token(rng: random.Random) -> bytes:
    return rng.choice([b"", os.urandom(1), os.urandom(TOKEN_BYTES - 1), os.urandom(TOKEN_BYTES), os.urandom(TOKEN_BYTES + 1),
                       os.urandom(200), bytes(TOKEN_BYTES), b"\xff" * TOKEN_BYTES])


def _reap_peer(s: socket.socket, mode: str, t: Tally) -> bool:
    """Read what the daemon sent a flood peer; True once it is done with it (closed or answered)."""
    try:
        msg, fds, _, _ = socket.recv_fds(s, 512, 4)
    except BlockingIOError:
        return False
    except OSError:
        msg, fds = b"", []
        t.inc(f"{mode}:reset")
    for fd in fds:
        os.close(fd)
    if fds:
        t.inc(f"VIOLATION:fd_handed_to_{mode}_peer")
        t.note(f"VIOLATION the fd socket handed a descriptor to a {mode} peer")
    elif msg[:1] == b"\x01":
        t.inc(f"{mode}:refused")
    elif not msg:
        t.inc(f"{mode}:closed")  # its deadline, an eviction, or (an empty token) nothing to answer
    else:
        t.inc(f"{mode}:other_reply")
    return True


def _token_games(ctx: Ctx, t: Tally, path: str) -> None:
    """A token of our own: collected once (maybe after waiting out our own flood), never twice;
    an uncollected one dies with its session."""
    opened = _open_raw_session(ctx, t, os.getpid())
    if opened is None:
        return
    raw, _ = opened
    try:
        toks = []
        for _ in range(2):
            r = _ask(raw, t, P.RegisterHost.OP, raw.ids(), [4096], ctx.timeout)
            if r is None or r.error is not None:
                t.inc("token_games:no_segment")
                return
            toks.append(r.result["token"])
        try:
            os.close(fetch_fd(path, toks[0], timeout=ctx.timeout))
            t.inc("own_token:collected")
        except E.TransferError as exc:
            t.error(exc, "own_token")  # the flood is ours: our own fetch may be evicted, and retries
            return
        try:
            os.close(fetch_fd(path, toks[0], timeout=ctx.timeout))
            t.inc("VIOLATION:token_redeemed_twice")
            t.note("VIOLATION a token was redeemed twice")
        except E.ProtocolError:
            t.inc("second_redeem:refused")
        except E.TransferError as exc:
            t.error(exc, "second_redeem")
    finally:
        _close_raw(raw, t)
    try:
        os.close(fetch_fd(path, toks[1], timeout=ctx.timeout))
        t.inc("VIOLATION:token_outlived_its_session")
        t.note("VIOLATION a token was redeemed after its session closed")
    except E.ProtocolError:
        t.inc("token_after_close:refused")
    except E.TransferError as exc:
        t.error(exc, "token_after_close")


def attack_handover_flood(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    """Hundreds of connections to the fd socket that send nothing (replaced as the daemon closes
    them) and some that send garbage tokens. The good clients' segment() calls prove the rest."""
    path = _daemon_fd_socket(ctx)
    if path is None:
        t.inc("no_fd_socket")
        return
    target = rng.randint(200, 500)
    sel = selectors.DefaultSelector()
    held: dict[socket.socket, str] = {}
    connects = 0
    next_games = time.monotonic() + rng.uniform(0.2, 1.0)
    try:
        while ctx.left() and connects < 50_000:
            while len(held) < target and connects < 50_000:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
                try:
                    s.connect(path)
                except OSError as exc:  # EAGAIN: the backlog is full; try again next turn
                    s.close()
                    t.inc(f"connect:{errno.errorcode.get(exc.errno or 0, exc.errno)}")
                    break
                connects += 1
                mode = "garbage" if rng.random() < 0.1 else "silent"
                if mode == "garbage":
                    try:
                        s.send(_garbage_token(rng))
                    except OSError:
                        t.inc("garbage:send_failed")
                sel.register(s, selectors.EVENT_READ, mode)
                held[s] = mode
                t.inc(f"{mode}:connected")
            for key, _ in sel.select(0.05):
                s = key.fileobj  # type: ignore[assignment]
                if _reap_peer(s, key.data, t):
                    sel.unregister(s)
                    held.pop(s, None)
                    s.close()
            if time.monotonic() >= next_games:
                _token_games(ctx, t, path)
                next_games = time.monotonic() + rng.uniform(0.5, 1.5)
    finally:
        t.inc("held_at_end", len(held))
        for s in held:
            s.close()
        sel.close()


# --- 12. idle and slowloris connections to the metrics endpoint ---------------------------------
#: A connection the daemon did not close this long after our connect: its deadline failed.
METRICS_HELD_LIMIT_S = METRICS_TIMEOUT_S + 5.0
#: An accepted connection is held by the daemon this long after our connect without an answer:
#: more of those at once than the cap means the cap failed (the backlog is accepted quickly).
METRICS_SETTLED_S = 3.0


@dataclass(eq=False)
class _MetricsConn:
    sock: socket.socket
    mode: str
    born: float
    got: bytes = b""
    next_send: float = 0.0

    def status(self) -> str:
        return self.got[9:12].decode("ascii", "replace") if self.got.startswith(b"HTTP/") else ("junk" if self.got else "")


def _metrics_connect(port: int, mode: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if mode == "nonreader":  # a tiny window: the daemon's response stalls in its send
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.settimeout(1.0)
        s.connect(("127.0.0.1", port))
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


def _metrics_send(c: _MetricsConn, data: bytes, t: Tally) -> None:
    try:
        c.sock.send(data)
    except BlockingIOError:
        t.inc(f"{c.mode}:send_blocked")
    except OSError:
        t.inc(f"{c.mode}:send_failed")  # closed by the daemon: the read side says so too


def attack_metrics_flood(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    """Silent, slowloris (a header line every few hundred ms, never the end), oversized-head and
    never-reading connections, more than the endpoint's cap; plus a few whole scrapes. Each
    connection must be answered 503 beyond the cap, or closed within its deadline."""
    if not ctx.metrics_port:
        t.inc("skipped:no_metrics_port")
        return
    want = rng.randint(METRICS_CAP + 8, 4 * METRICS_CAP + 32)
    sel = selectors.DefaultSelector()
    conns: dict[socket.socket, _MetricsConn] = {}
    total = 0
    over_cap_noted = False
    try:
        while ctx.left() and total < 5_000:
            while len(conns) < want and total < 5_000:
                mode = rng.choice(["silent", "silent", "slowloris", "slowloris", "huge_head", "nonreader", "scrape"])
                try:
                    s = _metrics_connect(ctx.metrics_port, mode)
                except OSError as exc:
                    t.inc(f"connect:{type(exc).__name__}")
                    break
                total += 1
                c = _MetricsConn(s, mode, time.monotonic())
                conns[s] = c
                t.inc(f"{mode}:connected")
                if mode in ("scrape", "nonreader"):
                    _metrics_send(c, b"GET /metrics HTTP/1.0\r\n\r\n", t)
                elif mode == "slowloris":
                    _metrics_send(c, b"GET /metrics HTTP/1.1\r\n", t)
                    c.next_send = c.born + rng.uniform(0.2, 0.6)
                elif mode == "huge_head":
                    _metrics_send(c, b"GET /metrics HTTP/1.0\r\nX-Pad: " + b"a" * 9000, t)
                if mode != "nonreader":
                    sel.register(s, selectors.EVENT_READ, c)
            t.flush()  # (counts come in bursts: a SIGKILL between them must not take a burst with it)
            for key, _ in sel.select(0.1):
                c = key.data
                try:
                    data = c.sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if data:
                    c.got += data[: max(0, 64 - len(c.got))]
                    continue
                _metrics_closed(c, t)
                sel.unregister(c.sock)
                del conns[c.sock]
                c.sock.close()
            now = time.monotonic()
            settled = 0
            for c in list(conns.values()):
                age = now - c.born
                if c.mode == "slowloris" and now >= c.next_send and not c.got:
                    _metrics_send(c, b"X-Slow: %d\r\n" % int(age * 1000), t)
                    c.next_send = now + rng.uniform(0.2, 0.6)
                if c.mode in ("silent", "slowloris") and not c.got and age > METRICS_SETTLED_S:
                    settled += 1
                if age > METRICS_HELD_LIMIT_S:  # still open: the daemon's deadline did not close it
                    if c.mode != "nonreader":  # (a never-reading peer's close is not seen: not judged)
                        t.inc("VIOLATION:held_past_deadline")
                        t.note(f"VIOLATION a {c.mode} metrics connection was still open {age:.1f} s after connect")
                    else:
                        t.inc("nonreader:closed_by_us")
                    if c.mode != "nonreader":
                        sel.unregister(c.sock)
                    del conns[c.sock]
                    c.sock.close()
            if settled > METRICS_CAP:
                t.inc("VIOLATION:over_cap")
                if not over_cap_noted:
                    over_cap_noted = True
                    t.note(f"VIOLATION {settled} idle metrics connections held open at once (cap {METRICS_CAP})")
    finally:
        t.inc("open_at_end", len(conns))
        for s in conns:
            s.close()
        sel.close()


def _metrics_closed(c: _MetricsConn, t: Tally) -> None:
    """The daemon closed a connection: what it said first, and how long it held it."""
    held = time.monotonic() - c.born
    t.inc(f"{c.mode}:{c.status() or 'closed'}")
    if c.status() in ("", "junk"):
        t.inc("held:" + ("<1s" if held < 1 else f"<{METRICS_TIMEOUT_S + 1:g}s" if held < METRICS_TIMEOUT_S + 1 else "longer"))


# --- 13. names built on the instance id, squatted --------------------------------------------------
_LOCK_NAME = re.compile(r"transfer\.([0-9a-f]+)\.lock")
#: What the daemon once named in the shm dir, and what a guess would try next.
SQUAT_SUFFIXES = ("bell", "cbell", "bell-0", "bell-1", "cbell-0", "fds", "ring", "ring-0", "ring-1", "ring-2", "ring-63",
                  "seg", "seg-0", "seg-1", "seg-2", "seg-4095", "sock", "ctl", "metrics")
_MARK = b"squatted by the hostile soak\n"


class Squats:
    """Files, FIFOs, directories, symlinks and sockets made at names in the shm dir.

    Every path is written to `manifest` before it is made: a SIGKILLed episode leaves no
    name the soak does not know of, and the soak removes the listed paths once every
    attacker is gone, before it requires the shm dir to hold only the lock and fd socket."""

    def __init__(self, directory: Path, manifest: Path, t: Tally) -> None:
        self.dir, self.manifest, self.t = directory, manifest, t
        self.made: list[tuple[Path, str]] = []
        self.readers: dict[Path, int] = {}
        self.socks: dict[Path, socket.socket] = {}
        self.target: Path | None = None

    def _listed(self, path: Path) -> None:
        with open(self.manifest, "a") as f:
            f.write(f"{path}\n")

    def make(self, name: str, kind: str) -> None:
        path = self.dir / name
        self._listed(path)
        try:
            if kind == "file":
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
                os.write(fd, _MARK)
                os.close(fd)
            elif kind == "fifo":
                os.mkfifo(path, 0o666)
                self.readers[path] = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a reader: a writer's bytes would wait here
            elif kind == "dir":
                os.mkdir(path, 0o777)
            elif kind == "symlink":
                os.symlink(self._target(), path)
            else:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                s.bind(str(path))
                s.listen(4)
                s.setblocking(False)
                self.socks[path] = s
        except FileExistsError:
            self.t.inc("squat:exists")  # another squat episode's, or the daemon's own
            return
        except OSError as exc:
            self.t.inc(f"squat:{errno.errorcode.get(exc.errno or 0, exc.errno)}")
            return
        self.made.append((path, kind))
        self.t.inc(f"squat:{kind}")

    def _target(self) -> Path:
        """The file every symlink points at: a write through any of them shows in it."""
        if self.target is None:
            self.target = self.dir / f"transfer.squat-target.{os.urandom(8).hex()}"
            self._listed(self.target)
            fd = os.open(self.target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            os.write(fd, _MARK)
            os.close(fd)
        return self.target

    def check(self) -> None:
        """Nothing the squatter made was written, filled, connected to or removed."""
        for path, kind in self.made:
            what = self._touched(path, kind)
            if what:
                self.t.inc(f"VIOLATION:squat_{what}")
                self.t.note(f"VIOLATION the squatted {kind} {path.name} was {what.replace('_', ' ')}")
        if self.target is not None and self.target.read_bytes() != _MARK:
            self.t.inc("VIOLATION:squat_written_through_symlink")
            self.t.note("VIOLATION a squatted symlink's target was written")

    def _touched(self, path: Path, kind: str) -> str:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return "removed"
        if kind == "file" and (st.st_size != len(_MARK) or path.read_bytes() != _MARK):
            return "written"
        if kind == "fifo":
            try:
                if os.read(self.readers[path], 4096):
                    return "written"
            except BlockingIOError:
                pass
        if kind == "dir" and os.listdir(path):
            return "filled"
        if kind == "socket":
            try:
                conn, _ = self.socks[path].accept()
                conn.close()
                return "connected_to"
            except BlockingIOError:
                pass
        return ""

    def remove(self) -> None:
        for fd in self.readers.values():
            os.close(fd)
        for s in self.socks.values():
            s.close()
        for path, kind in self.made:
            with contextlib.suppress(OSError):
                if kind == "dir" and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        if self.target is not None:
            with contextlib.suppress(OSError):
                self.target.unlink()
        self.made.clear()


def _squat_names(inst: str, rng: random.Random) -> list[tuple[str, str]]:
    """(name, kind) pairs: every suffix on the instance, a few random transfer.* names. No socket
    takes a name like the daemon's fd socket's (`_daemon_fd_socket` would try it)."""
    names = [f"transfer.{inst}.{s}" for s in SQUAT_SUFFIXES]
    names += [f"transfer.{inst}.fds.{rng.getrandbits(64):016x}", f"transfer.{inst}.ring-{rng.randrange(1 << 16)}", f".transfer.{inst}.lock.tmp"]
    names += [f"transfer.{rng.getrandbits(64):016x}.{rng.choice(['lock', 'bell', 'ring-0', 'seg-0', 'fds'])}" for _ in range(4)]
    out = []
    for name in names:
        kinds = ["file", "file", "fifo", "dir", "symlink"] + ([] if _FDS_NAME.fullmatch(name) else ["socket"])
        out.append((name, rng.choice(kinds)))
    return out


def _live_instances(shm_dir: str) -> list[str]:
    """Instance ids from the names of the locks a live daemon holds (squatters leave unlocked
    `transfer.<random>.lock` files too: those are not instances)."""
    out = []
    for name in os.listdir(shm_dir):
        m = _LOCK_NAME.fullmatch(name)
        if m is None:
            continue
        try:
            fd = os.open(os.path.join(shm_dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # (taken, then let go with the fd: nobody holds it)
        except BlockingIOError:
            out.append(m.group(1))
        except OSError:
            pass
        finally:
            os.close(fd)
    return out


def _ring_still_works(ctx: Ctx, t: Tally, rng: random.Random) -> str:
    """A ring client's whole round: "" if it got a ring and its bytes came back, else what failed."""
    data = np.frombuffer(rng.randbytes(64 << 10), np.uint8)
    with transfer.connect(ctx.endpoint, name="squat-victim", ring=True, connect_timeout=10.0, liveness_timeout=10.0) as c:
        if not c.ring:
            return "no_ring"
        seg = c.segment(64 << 10)
        seg.buffer[:] = data
        buf = c.alloc(64 << 10)
        c.copy(buf, seg).result(10.0)
        c.fill(seg, 64 << 10, 0).result(10.0)
        c.copy(seg, buf).result(10.0)
        c.fence(timeout=10.0)
        if c.checksum(buf, 64 << 10).result(10.0) != transfer.checksum64(data) or bytes(seg.buffer) != data.tobytes():
            return "wrong_bytes"
    return ""


def attack_squat(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    """Squat every name built on the daemon's instance id (read from its lock's name) and random
    transfer.* names; a new ring client must still get a working ring, and nothing squatted may
    be written, filled, connected to or removed by the daemon."""
    insts = _live_instances(ctx.shm_dir)
    if not insts:
        t.inc("no_lock")
        return
    for _ in range(500):
        if not ctx.left():
            return
        sq = Squats(Path(ctx.shm_dir), t.path.with_suffix(".created"), t)
        try:
            for inst in insts:
                for name, kind in _squat_names(inst, rng):
                    sq.make(name, kind)
            t.flush(force=True)
            for attempt in range(2):  # want of resources (other attackers hold them) says nothing of names: once more
                try:
                    failed = _ring_still_works(ctx, t, rng)
                except (E.ResourceError, E.ConnectionLost) as exc:
                    failed = f"failed:{type(exc).__name__}"
                    if attempt == 0:
                        t.inc(f"ring_retry:{type(exc).__name__}")
                        continue
                except E.TransferError as exc:
                    failed = f"failed:{type(exc).__name__}"
                break
            if failed:
                t.inc(f"VIOLATION:squat_ring_{failed}")
                t.note(f"VIOLATION with {len(sq.made)} names squatted a ring client got: {failed}")
            else:
                t.inc("ring_ok")
            sq.check()
        finally:
            sq.remove()


# --- 14. a hostile daemon: the client may fail, only with TransferError or OSError ---------------
FAKE_TARGETS: tuple[type[P.Request], ...] = (P.Hello, P.RegisterHost, P.OpenRing, P.Alloc, P.Share, P.Attach, P.Stats,
                                             P.Checksum, P.ChecksumV, P.Fence, P.Copy, P.Close, P.Ping)
FAKE_SEGMENT, FAKE_BUFFER = 5 << 40, 6 << 40


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _bad_value(t: Tally, what: str) -> None:
    t.inc("VIOLATION:client_accepted_bad_value")
    t.note(f"VIOLATION the client accepted {what}"[:300])


def _victim(fake: FakeDaemon, target: type[P.Request], t: Tally, rng: random.Random) -> None:
    """A real client against the fake; the call the breakage targets. Checks what it accepted."""
    # Deferred creation takes in hello's arenas: a hello is tried with it; Alloc needs it off.
    deferred = target is P.Hello or (target is not P.Alloc and rng.random() < 0.5)
    c = transfer.connect(fake.endpoint, name="victim", ring=target is P.OpenRing, deferred=deferred, connect_timeout=3.0,
                         liveness_timeout=3.0, watch_daemon_pid=rng.random() < 0.5)
    try:
        if target is P.Hello and deferred:  # a buffer from the arena hello granted, and its first use
            b = c.alloc(4096)
            c.fill(b, 4096, 1).result(3.0)
        if not (0 <= c.server_pid <= PID_MAX and math.isfinite(c._core.heartbeat_s) and c._core.heartbeat_s > 0):
            _bad_value(t, f"a hello with server_pid {c.server_pid}, heartbeat {c._core.heartbeat_s}")
        if c.server_pid == 0:  # a Pid may be 0 (no process): the client then watches none
            t.inc("hello:server_pid_0_accepted")
        if target is P.RegisterHost:
            seg = c.segment(4096)
            if seg.nbytes != 4096 or len(seg.buffer) != 4096:
                _bad_value(t, f"a segment of {seg.nbytes} bytes mapped as {len(seg.buffer)} (asked 4096)")
            seg.buffer[:] = 1  # the mapping is usable
        elif target is P.Alloc:
            b = c.alloc(4096)
            if not (0 <= b.va <= U64 and 0 <= b.nbytes <= U64):
                _bad_value(t, f"a buffer va {b.va} nbytes {b.nbytes}")
            if b.nbytes != 4096:  # within its declared type, and nothing of the client's is sized by it: counted
                t.inc("alloc:other_size_accepted")
        elif target is P.Share:
            c.share(c.alloc(4096))
        elif target is P.Attach:
            c.attach(b"t" * 16)
        elif target is P.Stats:
            if not isinstance(c.stats(), dict):
                _bad_value(t, "stats that are not a map")
        elif target is P.Checksum:
            v = c.checksum(FAKE_SEGMENT, 4096).result(3.0)
            if type(v) is not int or not 0 <= v <= U64:
                _bad_value(t, f"a checksum {v!r}")
        elif target is P.ChecksumV:
            v = c.checksum_many([FAKE_SEGMENT, FAKE_SEGMENT + 64], [64, 64]).result(3.0)
            if len(v) != 2:
                _bad_value(t, f"{len(v)} checksums for 2 ranges")
        elif target is P.Fence:
            c.fence(timeout=3.0)
        elif target is P.Copy:
            c.copy(FAKE_BUFFER, FAKE_SEGMENT, 64).result(3.0)
        elif target is P.Ping:
            time.sleep(rng.uniform(0.0, 2.0))  # the heartbeat's pings get the broken replies
            c.stats()
    finally:
        c.close()  # (the Close target: its reply is the broken one)


#: The fake_daemon attacker's address space: a client that sizes its memory by what a reply
#: says fails with MemoryError here (a VIOLATION) instead of taking the machine's memory.
FAKE_ADDRESS_SPACE = 4 << 30


def attack_fake_daemon(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    """The client side: a fake daemon in this process breaks one request type's replies (keys
    dropped, values replaced by any msgpack value, errors no daemon sends, garbage frames) or
    handovers at a time; every call of a real client must succeed or raise TransferError /
    OSError (anything else is a VIOLATION:client_crash), and what it accepts must be in range."""
    _fake_daemon(ctx, t, rng, edges=False)


def attack_fake_daemon_edges(ctx: Ctx, t: Tally, rng: random.Random) -> None:
    """As fake_daemon, with replies that keep their shape and set one number in them (nested
    too) to where an integer width ends, or to NaN/inf: half the rounds walk every number of a
    hello reply through its edge values (in a random order, so short episodes cover different
    ones), the others set one number of any reply."""
    _fake_daemon(ctx, t, rng, edges=True)


def _fake_daemon(ctx: Ctx, t: Tally, rng: random.Random, edges: bool) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (FAKE_ADDRESS_SPACE if hard == resource.RLIM_INFINITY else min(hard, FAKE_ADDRESS_SPACE), hard))
    work = Path(tempfile.mkdtemp(prefix="fake-", dir=t.path.parent))  # (the soak removes its workdir, SIGKILL or not)
    fake = FakeDaemon(work, rng)
    sweep = hello_edges(fake) if edges else []
    rng.shuffle(sweep)
    fds_before = _fd_count()
    try:
        for _ in range(1_000):
            if not ctx.left():
                break
            if sweep and rng.random() < 0.5:
                b = sweep.pop()
            else:
                b = draw_breakage(rng, rng.choice(FAKE_TARGETS), edges)
            target = b.target
            fake.arm(b)
            t.inc(f"break:{target.__name__}:{b.kind}")
            try:
                _victim(fake, target, t, rng)
                t.inc("client:ok")
            except (E.TransferError, OSError) as exc:
                t.error(exc, "client")
            except Exception as exc:  # noqa: BLE001 - what the client must never raise
                t.inc("VIOLATION:client_crash")
                t.note(f"VIOLATION the client raised {type(exc).__name__}: {exc} (breakage {b})"[:300])
            finally:
                fake.arm(None)
        t.inc("replies_broken", fake.broke)
        grown = _fd_count() - fds_before
        if grown > 16:  # every client closed: what is left open leaked
            t.inc("client_fds_leaked", grown)
            t.note(f"{grown} descriptors left open in the attacker after its clients closed")
        for err in fake.errors[:3]:
            t.inc("attacker_bug:fake_daemon")
            t.note(f"the fake daemon failed: {err}")
    finally:
        fake.close()
        shutil.rmtree(work, ignore_errors=True)


ATTACKS: dict[str, Callable[[Ctx, Tally, random.Random], None]] = {
    "fuzz": attack_fuzz,
    "forged_va": attack_forged_va,
    "churn": attack_churn,
    "silent_flood": attack_silent_flood,
    "flood": attack_flood,
    "hog": attack_hog,
    "ring": attack_ring,
    "compute": attack_compute,
    "compute_zero_stride": attack_compute_zero_stride,
    "truncate_segment": attack_truncate_segment,
    "truncate_ring": attack_truncate_ring,
    "midkill": attack_midkill,
    "pid_extremes": attack_pid_extremes,
    "handover_flood": attack_handover_flood,
    "metrics_flood": attack_metrics_flood,
    "squat": attack_squat,
    "fake_daemon": attack_fake_daemon,
    "fake_daemon_edges": attack_fake_daemon_edges,
}


def run_attack(kind: str, endpoint: str, shm_dir: str, daemon_pid: int, out: str, length: float, deadline: float, seed: int,
               metrics_port: int = 0) -> None:
    """Process entry point: one episode of `length` seconds from now (the process's start-up
    does not count), ending by `deadline` at the latest; every exception is counted, never raised."""
    t = Tally(Path(out), kind)
    deadline = min(time.time() + length, deadline)
    rng = random.Random(seed)
    ctx = Ctx(endpoint, shm_dir, daemon_pid, deadline, metrics_port=metrics_port)
    try:
        ATTACKS[kind](ctx, t, rng)
    except E.TransferError as exc:
        t.error(exc, "episode")
    except Exception as exc:  # noqa: BLE001 - an attack's own bug is counted, not hidden
        t.inc(f"attacker_bug:{type(exc).__name__}")
        t.note(f"attacker exception {type(exc).__name__}: {exc}"[:300])
    t.flush(done=True)
