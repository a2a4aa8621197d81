"""The attacks. Each runs in its own (spawned) process for one bounded episode.

An attack is `fn(ctx, tally, rng)`: it loops until `ctx.deadline` (wall clock) or its
own iteration bound, counts what it did in `tally` (requests sent, error classes
received, defended attempts, violations), and returns. Every attack talks only to
the daemon's private ipc endpoint on this machine.

A *violation* (`VIOLATION:*` counts, with a note) is a request the daemon should have
refused but served: a forged VA that reached another session's memory, say.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

import transfer
from transfer import errors as E
from transfer import protocol as P
from transfer._ring import Op as RingOp
from transfer.addressing import OFFSET_BITS

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
            else:  # the memory the daemon hands out, collected by hand (fd or path, whichever it gives)
                info = c._call(P.RegisterHost, 1 << 20, timeout=ctx.timeout)
                fds = [c._core.collect(info["token"])] if "token" in info else []
                try:
                    done = _truncate(t, "handed_out", fds, info.get("path"))
                finally:
                    for fd in fds:
                        os.close(fd)
                va = info["va"]
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
}


def run_attack(kind: str, endpoint: str, shm_dir: str, daemon_pid: int, out: str, length: float, deadline: float, seed: int) -> None:
    """Process entry point: one episode of `length` seconds from now (the process's start-up
    does not count), ending by `deadline` at the latest; every exception is counted, never raised."""
    t = Tally(Path(out), kind)
    deadline = min(time.time() + length, deadline)
    rng = random.Random(seed)
    ctx = Ctx(endpoint, shm_dir, daemon_pid, deadline)
    try:
        ATTACKS[kind](ctx, t, rng)
    except E.TransferError as exc:
        t.error(exc, "episode")
    except Exception as exc:  # noqa: BLE001 - an attack's own bug is counted, not hidden
        t.inc(f"attacker_bug:{type(exc).__name__}")
        t.note(f"attacker exception {type(exc).__name__}: {exc}"[:300])
    t.flush(done=True)
