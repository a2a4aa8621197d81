"""Proof of equivalence: every request path gives the same memory and the same replies.

A hypothesis program is a random sequence of copy, copy_many, fill, checksum,
compute, a graph run (relu, on the ring where the client has one) and fence over a small universe (two host segments, two device
buffers, a freed segment, a segment that never existed), some of the requests
invalid (out of bounds, freed or unknown segments, sizes past 2**63, fill
values that are not a byte, compute with mismatched shapes, overlapping
outputs, unknown operators). The same program runs through every path:

* client: the blocking client (`transfer.connect`) and the trio client
  (`transfer.open_client`);
* streams: requests go out on streams 0, 1 and 2 in turn (the daemon's
  per-session lanes; the stream simulation flags two lanes racing);
* transport: the control socket, and the shared-memory request ring
  (`ring=True`), for both clients;
* submission: one request at a time (each one waited for before the next:
  the daemon's inline path), pipelined (everything submitted, results
  collected at the end), and batched (`with c.batch():` frames);
* daemon: default settings (rings served by native workers), settings that
  force data work onto worker threads and split the program into many small
  scheduler passes (``--inline-bytes 0 --max-pass 2``), rings served by the
  event loop's pass (``--no-ring-workers``), a simulated GPU, and a simulated
  GPU whose buffers are the fake CUDA driver's memory (tests/fakecuda), so
  that the ring workers queue device copies and fills through the driver
  (native/device.c) while the Python pass serves the rest; the fake counts
  every misuse, and the module fails if it saw one.

Every path must give identical per-request outcomes (result value, or
exception class and message, with VAs and segment ids named symbolically
since each session has its own) and identical final contents of every
segment and buffer; and both must equal a plain NumPy model that executes the
program one request at a time.

One difference is by definition, not by path: `fence()` raises the first
failure *nobody has looked at*. Waiting for each request looks at it, so in
one-at-a-time submission a fence never raises; pipelined, it raises the first
failure since the previous fence. Fence outcomes are therefore compared
within each submission style (and against the model for that style).

Each daemon configuration is started once per module and each path keeps one
client across examples; every example resets the memory first.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import signal
import shutil
import tempfile
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import transfer
from transfer.addressing import MAX_SEGMENT_ID, make_va, split_va
from transfer.testing import DaemonProcess, start_daemon, stop_process

from conftest import FAST
import fakecuda

# --- the universe ------------------------------------------------------------------------------
SIZES = {"h0": 4096, "h1": 4096, "d0": 4096, "d1": 2048}
HOST = ("h0", "h1")
DEVICE = ("d0", "d1")
#: Regions a request may name: the four above, a segment freed at setup, one that never existed.
BAD_REGIONS = ("dead", "nowhere")
NOWHERE_VA = make_va(MAX_SEGMENT_ID, 0)
STAGE = 8192  # a host segment outside the program, for loading and reading back device buffers
TIMEOUT = 20.0
HUGE = (1 << 40, 1 << 63, (1 << 64) - 1)  # sizes no segment has (all valid u64s)

DAEMONS = {
    "default": [],
    "threads": ["--inline-bytes", "0", "--max-pass", "2"],
    # Rings served by the event loop's pass, not native workers (those are the default).
    "loop": ["--no-ring-workers"],
    # A simulated GPU (device work queued until the stream is synchronized): device buffers live there.
    "streamsim": ["--backend", "streamsim"],
    # The same, over the fake CUDA driver: ring copies and fills of device memory are the workers'.
    "fakecuda": ["--backend", "streamsim"],
}
#: Submission styles: "seq" waits for each request; "pipe" submits all, collects at the end;
#: "batch" is "pipe" inside `with c.batch():` (for trio, batches end at each fence).
STYLES = ("seq", "pipe", "batch")


def trio_has_ring() -> bool:
    return "ring" in inspect.signature(transfer.open_client).parameters


# --- programs -------------------------------------------------------------------------------------
Addr = tuple[str, int]  # (region, offset)


@st.composite
def addr(draw: st.DrawFn, n: int, align: int = 1, valid: bool | None = None) -> Addr:
    """A place for `n` bytes: mostly in bounds of a real region, sometimes not, sometimes nowhere."""
    if valid is None:
        valid = draw(st.integers(0, 9)) < 8
    if not valid and draw(st.integers(0, 2)) == 0:
        return draw(st.sampled_from(BAD_REGIONS)), draw(st.integers(0, 64)) * align
    region = draw(st.sampled_from(["h0", "h0", "h1", "h1", "d0", "d1"]))
    size = SIZES[region]
    if valid and n <= size:
        return region, draw(st.integers(0, (size - n) // align)) * align
    lo = max(0, size - n + 1)
    return region, draw(st.integers(-(-lo // align), (size + 64) // align)) * align


def nbytes_st(max_n: int = 1024) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, max_n), st.integers(0, max_n), st.integers(0, max_n), st.integers(0, 16), st.sampled_from(HUGE))


@st.composite
def copy_op(draw: st.DrawFn) -> tuple:
    n = draw(nbytes_st())
    dst = draw(addr(n))
    if draw(st.integers(0, 2)) == 0 and dst[0] in SIZES and n <= SIZES[dst[0]]:
        # the same segment, near the destination: overlapping copies in both directions
        size = SIZES[dst[0]]
        so = min(max(0, dst[1] + draw(st.integers(-64, 64))), size - n)
        src = (dst[0], so)
    else:
        src = draw(addr(n))
    return ("copy", dst, src, n)


@st.composite
def copy_many_op(draw: st.DrawFn) -> tuple:
    k = draw(st.integers(1, 4))
    valid = draw(st.integers(0, 3)) > 0
    pieces = []
    for _ in range(k):
        n = draw(st.integers(0, 512))
        pieces.append((draw(addr(n, valid=True if valid else None)), draw(addr(n, valid=True if valid else None)), n))
    return ("copy_many", tuple(pieces))


@st.composite
def fill_op(draw: st.DrawFn) -> tuple:
    n = draw(nbytes_st())
    value = draw(st.one_of(st.integers(0, 255), st.integers(0, 255), st.sampled_from([256, 1000])))
    return ("fill", draw(addr(n)), n, value)


@st.composite
def checksum_op(draw: st.DrawFn) -> tuple:
    n = draw(nbytes_st())
    return ("checksum", draw(addr(n)), n)


@st.composite
def compute_op(draw: st.DrawFn) -> tuple:
    """("compute", op, [(addr, dtype, shape)], [(addr, dtype, shape)], params)."""
    kind = draw(st.sampled_from(["scale_add", "scale_add", "cast", "checksum", "fft"]))
    count = draw(st.integers(1, 128))
    if kind == "scale_add":
        x = draw(addr(4 * count, align=4))
        ycount = count if draw(st.integers(0, 5)) else count + 1  # sometimes shapes differ
        if draw(st.integers(0, 2)) == 0:
            y = x  # exactly in place: allowed
        elif draw(st.integers(0, 3)) == 0 and x[0] in SIZES:
            y = (x[0], max(0, x[1] + 4 * draw(st.integers(-8, 8))))  # near x: often a partial overlap
        else:
            y = draw(addr(4 * ycount, align=4))
        params = {"a": draw(st.sampled_from([0.5, 2.0, -1.0, 1.0])), "b": draw(st.sampled_from([0.0, 1.0, -3.25]))}
        return ("compute", "scale_add", ((x, "float32", (count,)),), ((y, "float32", (ycount,)),), params)
    if kind == "cast":
        x = draw(addr(count))
        ycount = count if draw(st.integers(0, 5)) else count + 1
        y = draw(addr(4 * ycount, align=4))
        return ("compute", "cast", ((x, "uint8", (count,)),), ((y, "float32", (ycount,)),), {})
    x = draw(addr(count))
    return ("compute", kind, ((x, "uint8", (count,)),), ((x, "uint8", (count,)),) if kind == "fft" else (), {})


@st.composite
def graph_op(draw: st.DrawFn) -> tuple:
    """("graph", x, y): the session's graph (relu over 4x4 float32, 64 B) run on VAs: over the
    ring where the client has one (one input, one output), else the socket. y == x is in place."""
    x = draw(addr(64, align=4))
    if draw(st.integers(0, 3)) == 0:
        y = x
    elif draw(st.integers(0, 3)) == 0 and x[0] in SIZES:
        y = (x[0], max(0, x[1] + 4 * draw(st.integers(-8, 8))))  # near x: often a partial overlap
    else:
        y = draw(addr(64, align=4))
    return ("graph", x, y)


OP = st.one_of(copy_op(), copy_op(), copy_many_op(), fill_op(), checksum_op(), compute_op(), graph_op(), st.just(("fence",)))
PROGRAM = st.lists(OP, min_size=1, max_size=25)


# --- the reference model: one request at a time, in NumPy ------------------------------------------
class Invalid(Exception):
    pass


def reference(init: dict[str, np.ndarray], program: list[tuple]) -> tuple[list[tuple], dict[str, bytes]]:
    """Outcomes ("ok", value) / ("err",) per request, and the final memory.

    Fence outcomes are those of one-at-a-time submission (None); `fence_pipelined`
    gives the pipelined ones.
    """
    mem = {k: v.copy() for k, v in init.items()}

    def view(a: Addr, n: int) -> np.ndarray:
        region, off = a
        if region not in mem or not 0 <= n < (1 << 64) or off > SIZES[region] or n > SIZES[region] - off:
            raise Invalid
        return mem[region][off : off + n]

    def tensor(spec: tuple) -> tuple[np.ndarray, tuple[str, int, int]]:
        (region, off), dtype, shape = spec
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return view((region, off), n).view(dtype).reshape(shape), (region, off, off + n)

    out: list[tuple] = []
    for op in program:
        try:
            kind = op[0]
            if kind == "copy":
                _, dst, src, n = op
                s = view(src, n).copy()
                view(dst, n)[:] = s
                out.append(("ok", None))
            elif kind == "copy_many":
                for d, s, n in op[1]:  # the whole vector is checked before any copy
                    view(d, n), view(s, n)
                for d, s, n in op[1]:
                    view(d, n)[:] = view(s, n).copy()
                out.append(("ok", None))
            elif kind == "fill":
                _, dst, n, value = op
                if not 0 <= value <= 255:
                    raise Invalid
                view(dst, n)[:] = value
                out.append(("ok", None))
            elif kind == "checksum":
                _, src, n = op
                out.append(("ok", transfer.checksum64(view(src, n))))
            elif kind == "compute":
                _, name, ins, outs, params = op
                if name not in ("scale_add", "cast", "checksum"):
                    raise Invalid
                if outs and ins[0][2] != outs[0][2]:
                    raise Invalid  # shapes differ
                xs = [tensor(t) for t in ins]
                ys = [tensor(t) for t in outs]
                for y, (yr, ya, yb) in ys:
                    for (xr, xa, xb), spec in zip([r for _, r in xs], ins):
                        if yr == xr and ya < xb and xa < yb and (ya, yb) != (xa, xb):
                            in_place = name == "scale_add" and (ya, yb) == (xa, xb) and outs[0] == ins[0]
                            if not in_place:
                                raise Invalid  # an output overlapping an input
                if name == "checksum":
                    out.append(("ok", transfer.checksum64(xs[0][0])))
                    continue
                x, y = xs[0][0], ys[0][0]
                if name == "cast":
                    y[...] = x.astype(np.float32)
                else:
                    with np.errstate(all="ignore"):  # random bytes are NaNs and infinities too
                        r = np.multiply(x, np.float32(params["a"]))
                        if params["b"]:
                            np.add(r, np.float32(params["b"]), out=r)
                    y[...] = r
                out.append(("ok", None))
            elif kind == "graph":
                _, x, y = op
                (xv, (xr, xa, xb)), (yv, (yr, ya, yb)) = tensor((x, "float32", (4, 4))), tensor((y, "float32", (4, 4)))
                if yr == xr and ya < xb and xa < yb and (ya, yb) != (xa, xb):
                    raise Invalid  # the output overlaps the input, not exactly (relu works in place)
                np.maximum(xv, np.float32(0), out=yv)
                out.append(("ok", None))
            elif kind == "fence":
                out.append(("ok", None))
            else:  # pragma: no cover
                raise AssertionError(op)
        except Invalid:
            out.append(("err",))
    return out, {k: bytes(v) for k, v in mem.items()}


def refused_at_submission(op: tuple) -> bool:
    """The client refuses what no transport can carry (a fill value that is not a byte) when it
    is submitted: the caller sees the error there, so no fence reports it again."""
    return op[0] == "fill" and not 0 <= op[3] <= 255


def fence_pipelined(program: list[tuple], ref: list[tuple]) -> dict[int, bool]:
    """Pipelined: does fence i raise (a request since the previous fence failed)?"""
    raises, failed = {}, False
    for i, (op, r) in enumerate(zip(program, ref)):
        if op[0] == "fence":
            raises[i], failed = failed, False
        elif r[0] == "err" and not refused_at_submission(op):
            failed = True
    return raises


# --- one client per path ------------------------------------------------------------------------------
_HEX = re.compile(r"0x[0-9a-f]+")
_SITE = re.compile(r"graph created at \S+, ")  # where each client defined it: not a path's outcome
_SEG = re.compile(r"segment (\d+)")


@dataclass(repr=False)
class Path_:
    name: str
    style: str
    trio: bool
    client: Any
    env: dict[str, int]  # region -> base VA
    host: dict[str, Any]  # h0, h1, stage -> HostSegment
    names: dict[int, str] = field(default_factory=dict)  # segment id -> region
    host_runner: Any = None
    #: Requests go out on streams 0, 1, 2 in turn: the result must not depend on streams (lanes).
    submitted: int = 0

    def __repr__(self) -> str:
        return f"<path {self.name}>"

    def __post_init__(self) -> None:
        self.names = {split_va(va)[0]: k for k, va in self.env.items() if k != "nowhere"}

    def norm(self, msg: str) -> str:
        def hexrep(m: re.Match[str]) -> str:
            sid, off = split_va(int(m.group(0), 16))
            return f"<{self.names[sid]}+{off:#x}>" if sid in self.names else m.group(0)

        msg = _HEX.sub(hexrep, _SITE.sub("graph, ", msg))
        return _SEG.sub(lambda m: f"segment <{self.names.get(int(m.group(1)), m.group(1))}>", msg)

    def outcome(self, exc: BaseException | None, value: Any = None, notes: bool = False) -> tuple:
        if exc is None:
            return ("ok", value)
        msg = self.norm(str(exc))
        if notes:
            msg += "".join(" | " + n for n in getattr(exc, "__notes__", ()))
        return ("err", type(exc).__name__, msg)

    def va(self, a: Addr) -> int:
        return self.env[a[0]] + a[1]

    def tensor(self, spec: tuple) -> transfer.TensorRef:
        a, dtype, shape = spec
        return transfer.TensorRef(self.va(a), dtype, tuple(shape))

    def submit(self, c: Any, op: tuple) -> Any:
        kind = op[0]
        self.submitted += 1
        stream = self.submitted % 3
        if kind == "copy":
            return c.copy(self.va(op[1]), self.va(op[2]), op[3], stream=stream)
        if kind == "copy_many":
            return c.copy_many([self.va(d) for d, _, _ in op[1]], [self.va(s) for _, s, _ in op[1]], [n for _, _, n in op[1]], stream=stream)
        if kind == "fill":
            return c.fill(self.va(op[1]), op[2], op[3], stream=stream)
        if kind == "checksum":
            return c.checksum(self.va(op[1]), op[2], stream=stream)
        if kind == "compute":
            _, name, ins, outs, params = op
            return c.compute(name, [self.tensor(t) for t in ins], [self.tensor(t) for t in outs], dict(params), stream=stream)
        if kind == "graph":
            return c.run_graph(self.host["graph"], [self.va(op[1])], [self.va(op[2])], stream=stream)
        raise AssertionError(op)


def _setup_sync(c: transfer.Client) -> tuple[dict[str, int], dict[str, Any]]:
    h = {k: c.segment(SIZES[k]) for k in HOST}
    h["stage"] = c.segment(STAGE)
    dead = c.segment(4096)
    env = {k: h[k].va for k in HOST}
    env.update({k: c.alloc(SIZES[k]).va for k in DEVICE})
    env.update(dead=dead.va, nowhere=NOWHERE_VA, stage=h["stage"].va)
    c.free(dead)
    h["graph"] = _relu_graph(c)
    return env, h


async def _setup_trio(c: transfer.TrioClient) -> tuple[dict[str, int], dict[str, Any]]:
    h = {k: await c.segment(SIZES[k]) for k in HOST}
    h["stage"] = await c.segment(STAGE)
    dead = await c.segment(4096)
    env = {k: h[k].va for k in HOST}
    env.update({k: (await c.alloc(SIZES[k])).va for k in DEVICE})
    env.update(dead=dead.va, nowhere=NOWHERE_VA, stage=h["stage"].va)
    await c.free(dead)
    h["graph"] = _relu_graph(c)
    return env, h


def _relu_graph(c: Any) -> transfer.Graph:
    """The session's graph for "graph" ops (defined with its first run, deferred)."""
    g = c.graph()
    g.input("x", (4, 4), "float32")
    g.output("y", (4, 4), "float32")
    g.op("relu", ["x"], "y")
    return g


# --- running a program ------------------------------------------------------------------------------------
def run_sync(p: Path_, init: dict[str, np.ndarray], program: list[tuple]) -> tuple[list[tuple], dict[str, bytes]]:
    c, stage = p.client, p.host["stage"]
    for k in HOST:
        p.host[k].buffer[:] = init[k]
    for k in DEVICE:
        stage.buffer[: SIZES[k]] = init[k]
        c.copy(p.env[k], stage.va, SIZES[k]).result(TIMEOUT)
    c.fence(timeout=TIMEOUT)
    out: list[tuple | None] = [None] * len(program)
    waiting: dict[int, Any] = {}
    with c.batch() if p.style == "batch" else contextlib.nullcontext():
        for i, op in enumerate(program):
            try:
                if op[0] == "fence":
                    c.fence(timeout=TIMEOUT)
                    out[i] = p.outcome(None)
                    continue
                pending = p.submit(c, op)
            except Exception as exc:  # refused before it left
                out[i] = p.outcome(exc, notes=op[0] == "fence")
                continue
            if p.style == "seq":
                out[i] = _settle(p, lambda: pending.result(TIMEOUT))
            else:
                waiting[i] = pending
    for i, pending in waiting.items():
        out[i] = _settle(p, lambda: pending.result(TIMEOUT))
    with contextlib.suppress(transfer.TransferError):
        c.fence(timeout=TIMEOUT)
    mem = {k: bytes(p.host[k].buffer) for k in HOST}
    for k in DEVICE:
        c.copy(stage.va, p.env[k], SIZES[k]).result(TIMEOUT)
        mem[k] = bytes(stage.buffer[: SIZES[k]])
    return out, mem  # type: ignore[return-value]


def _settle(p: Path_, get: Callable[[], Any]) -> tuple:
    try:
        return p.outcome(None, get())
    except Exception as exc:
        return p.outcome(exc)


async def run_trio(p: Path_, init: dict[str, np.ndarray], program: list[tuple]) -> tuple[list[tuple], dict[str, bytes]]:
    c, stage = p.client, p.host["stage"]
    for k in HOST:
        p.host[k].buffer[:] = init[k]
    for k in DEVICE:
        stage.buffer[: SIZES[k]] = init[k]
        await c.copy(p.env[k], stage.va, SIZES[k])
    await c.fence()
    out: list[tuple | None] = [None] * len(program)
    waiting: dict[int, Any] = {}
    batch: contextlib.AbstractContextManager[Any] | None = None
    with trio.fail_after(TIMEOUT * 2):
        for i, op in enumerate(program):
            if p.style == "batch" and batch is None and op[0] != "fence":
                batch = c.batch()
                batch.__enter__()
            try:
                if op[0] == "fence":
                    if batch is not None:  # a trio fence awaits a reply: the batch must leave first
                        batch.__exit__(None, None, None)
                        batch = None
                    await c.fence()
                    out[i] = p.outcome(None)
                    continue
                pending = p.submit(c, op)
            except Exception as exc:
                out[i] = p.outcome(exc, notes=op[0] == "fence")
                continue
            if p.style == "seq":
                try:
                    out[i] = p.outcome(None, await pending)
                except Exception as exc:
                    out[i] = p.outcome(exc)
            else:
                waiting[i] = pending
        if batch is not None:
            batch.__exit__(None, None, None)
        for i, pending in waiting.items():
            try:
                out[i] = p.outcome(None, await pending)
            except Exception as exc:
                out[i] = p.outcome(exc)
        with contextlib.suppress(transfer.TransferError):
            await c.fence()
        mem = {k: bytes(p.host[k].buffer) for k in HOST}
        for k in DEVICE:
            await c.copy(stage.va, p.env[k], SIZES[k])
            mem[k] = bytes(stage.buffer[: SIZES[k]])
    return out, mem  # type: ignore[return-value]


# --- a trio event loop in a thread, so trio clients outlive one example --------------------------------------
class TrioHost:
    def __init__(self) -> None:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), name="equivalence-trio", daemon=True)
        self._thread.start()
        assert self._ready.wait(30)

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def run(self, afn: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run(afn, *args, trio_token=self.token)

    async def _hold(self, endpoint: str, kw: dict[str, Any], close: trio.Event, *, task_status: Any) -> None:
        async with transfer.open_client(endpoint, **kw) as c:
            env, host = await _setup_trio(c)
            task_status.started((c, env, host))
            await close.wait()

    def open(self, endpoint: str, **kw: Any) -> tuple[Any, dict[str, int], dict[str, Any], Callable[[], None]]:
        async def start() -> tuple[Any, trio.Event]:
            close = trio.Event()
            got = await self.nursery.start(self._hold, endpoint, kw, close)
            return got, close

        (c, env, host), close = self.run(start)
        return c, env, host, lambda: trio.from_thread.run_sync(close.set, trio_token=self.token)

    def stop(self) -> None:
        trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(30)


# --- fixtures ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """`env` in this process's environment for the block (a daemon started in it inherits it)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v



@pytest.fixture(scope="module")
def daemons() -> Iterator[dict[str, DaemonProcess]]:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shm = base / f"transfer-test-{uuid.uuid4().hex[:8]}"
    shm.mkdir(mode=0o700)
    run = Path(tempfile.mkdtemp(prefix="transfer-equiv-"))
    started: dict[str, DaemonProcess] = {}
    report = run / "fakecuda.report"
    try:
        for name, extra in DAEMONS.items():
            wd = run / name
            wd.mkdir(mode=0o700)
            env = {"TRANSFER_CUDA_DRIVER": str(fakecuda.build()), "FAKECUDA_REPORT": str(report)} if name == "fakecuda" else {}
            with _environ(env):
                # (each path's session idles while the others run, kept alive by heartbeats from one
                # busy test process: on a loaded machine the suite's 2 s timeout can reap one)
                started[name] = start_daemon([*FAST, "--session-timeout", "30", *extra], workdir=wd, shm_dir=shm)
        assert "CUDA device" in started["fakecuda"].ready.get("data_plane", "CUDA device"), started["fakecuda"].ready
        yield started
    finally:
        for d in started.values():
            d.stop()
        seen = fakecuda.report(report)
        assert not seen["violations"] and seen.get("executed", 0) > 0, seen
        shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="module")
def paths(daemons: dict[str, DaemonProcess]) -> Iterator[list[Path_]]:
    out: list[Path_] = []
    closers: list[Callable[[], None]] = []
    host = TrioHost()
    try:
        for dname, d in daemons.items():
            # (through the fake driver only the rings differ from the stream simulation: its
            # socket requests take the Python pass either way)
            for ring in (False, True) if dname != "fakecuda" else (True,):
                for style in ("seq", "batch") if not ring else STYLES:
                    c = transfer.connect(d.endpoint, ring=ring)
                    closers.append(c.close)
                    env, segs = _setup_sync(c)
                    out.append(Path_(f"{dname}/sync/{'ring' if ring else 'socket'}/{style}", style, False, c, env, segs))
            trio_rings = ((False, True) if dname != "fakecuda" else (True,)) if trio_has_ring() else (False,)
            for ring in trio_rings:
                for style in STYLES:
                    kw = {"ring": True} if ring else {}
                    c, env, segs, close = host.open(d.endpoint, **kw)
                    closers.append(close)
                    out.append(Path_(f"{dname}/trio/{'ring' if ring else 'socket'}/{style}", style, True, c, env, segs, host_runner=host))
        yield out
    finally:
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                close()
        host.stop()


def run_path(p: Path_, init: dict[str, np.ndarray], program: list[tuple]) -> tuple[list[tuple], dict[str, bytes]]:
    if p.trio:
        return p.host_runner.run(run_trio, p, init, program)
    return run_sync(p, init, program)


def describe(program: list[tuple]) -> str:
    return "\n".join(f"  [{i}] {op}" for i, op in enumerate(program))


# --- the property ----------------------------------------------------------------------------------------------
def _programs(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],  # no "explain": it reruns ~100 times
    )


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@_programs(12)
@given(program=PROGRAM, seed=st.integers(0, 2**32 - 1))
def test_every_path_gives_the_same_memory_and_replies(paths: list[Path_], program: list[tuple], seed: int) -> None:
    every_path_agrees(paths, program, seed)


@pytest.mark.slow
@pytest.mark.timeout(600)  # (five times the default's programs: minutes on a loaded machine, the module's daemons' stops included)
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@_programs(72)
@given(program=PROGRAM, seed=st.integers(0, 2**32 - 1))
def test_every_path_gives_the_same_memory_and_replies_deep(paths: list[Path_], program: list[tuple], seed: int) -> None:
    """The same property over six times as many programs (`-m slow`)."""
    every_path_agrees(paths, program, seed)


def every_path_agrees(paths: list[Path_], program: list[tuple], seed: int) -> None:
    """The program run on every path leaves the model's memory and replies, and each path's
    exact outcomes (error classes and messages) agree with every other's."""
    rng = np.random.default_rng(seed)
    init = {k: rng.integers(0, 256, n, dtype=np.uint8) for k, n in SIZES.items()}
    ref_out, ref_mem = reference(init, program)
    pipelined_fence = fence_pipelined(program, ref_out)
    fences = [i for i, op in enumerate(program) if op[0] == "fence"]

    results = {p.name: run_path(p, init, program) for p in paths}
    first = paths[0].name
    problems: list[str] = []

    # 1. each path against the model: which requests fail, values, memory
    for p in paths:
        out, mem = results[p.name]
        for i, (got, want) in enumerate(zip(out, ref_out)):
            if program[i][0] == "fence":
                should_raise = p.style != "seq" and pipelined_fence[i]
                if (got[0] == "err") != should_raise:
                    problems.append(f"{p.name}: fence [{i}]: expected {'an error' if should_raise else 'no error'}, got {got}")
            elif got[0] != want[0] or (want[0] == "ok" and got != want):
                problems.append(f"{p.name}: [{i}] {program[i][0]}: model says {want}, got {got}")
        for k in SIZES:
            if mem[k] != ref_mem[k]:
                diff = np.flatnonzero(np.frombuffer(mem[k], np.uint8) != np.frombuffer(ref_mem[k], np.uint8))
                problems.append(f"{p.name}: memory of {k} differs from the model at {diff.size} bytes, first at {diff[0]}")

    # 2. paths against each other: exact outcomes (error classes and messages), memory
    for p in paths[1:]:
        out, mem = results[p.name]
        base_out, base_mem = results[first]
        for i, (got, want) in enumerate(zip(out, base_out)):
            if program[i][0] == "fence":
                continue
            if got != want:
                problems.append(f"[{i}] {program[i][0]}: {first} -> {want}\n      {p.name} -> {got}")
        for k in SIZES:
            if mem[k] != base_mem[k]:
                problems.append(f"memory of {k}: {p.name} differs from {first}")
    for style in STYLES:
        group = [p for p in paths if p.style == style]
        for p in group[1:]:
            for i in fences:
                a, b = results[group[0].name][0][i], results[p.name][0][i]
                if a != b:
                    problems.append(f"fence [{i}] ({style}): {group[0].name} -> {a}\n      {p.name} -> {b}")

    assert not problems, "paths disagree for the program\n" + describe(program) + "\n" + "\n".join(problems)


def test_the_trio_client_takes_the_ring_too() -> None:
    """The ring variant of the trio client is one of the paths the property compares."""
    assert trio_has_ring()


# --- regressions: disagreements the property found between paths, each reduced to its minimum -----------------------


def test_fill_value_over_255_is_the_same_error_on_ring_and_socket(daemon) -> None:  # type: ignore[no-untyped-def]
    with transfer.connect(daemon.endpoint) as sock, transfer.connect(daemon.endpoint, ring=True) as ring:
        errors = []
        for c in (sock, ring):
            seg = c.segment(64)
            with pytest.raises(transfer.InvalidField) as info:
                c.fill(seg.va, 8, 256).result(TIMEOUT)
            errors.append(str(info.value))
        # socket: "Fill.value: 256 is outside u8 range [0, 255]"; ring: "fill value 256 is not a byte"
        assert errors[0] == errors[1]


@contextlib.contextmanager
def daemon_paused(d: DaemonProcess) -> Iterator[None]:
    """SIGSTOP the daemon while the block submits, so everything is waiting when it resumes
    (the reproductions below then do not depend on how busy the machine is)."""
    stop_process(d.pid)
    try:
        yield
    finally:
        os.kill(d.pid, signal.SIGCONT)


def test_ring_requests_run_before_a_later_socket_request(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """`_ring_ingest` drains at most max_pass descriptors before a frame; the rest run after it."""
    d = daemon_factory("--max-pass", "1")
    with transfer.connect(d.endpoint, ring=True) as c:
        seg = c.segment(4096)
        for trial in range(20):
            seg.buffer[:] = 0
            seg.buffer[16:24] = 1
            seg.buffer[24:32] = 2
            with daemon_paused(d):
                first = c.copy(seg.va + 64, seg.va + 128, 8)  # ring: unrelated
                ring_copy = c.copy(seg.va, seg.va + 16, 8)  # ring: seg[0:8] = 1
                socket_copy = c.copy_many([seg.va], [seg.va + 24], [8])  # socket (a vector): seg[0:8] = 2, submitted last
            first.result(TIMEOUT), ring_copy.result(TIMEOUT), socket_copy.result(TIMEOUT)
            assert (seg.buffer[:8] == 2).all(), f"trial {trial}: the socket request ran before the ring request submitted before it"


def test_fence_raises_the_first_failure_submitted(daemon) -> None:  # type: ignore[no-untyped-def]
    with transfer.connect(daemon.endpoint, ring=True) as c:
        seg = c.segment(4096)
        for trial in range(20):
            with daemon_paused(daemon):
                c.copy(NOWHERE_VA, seg.va, 8)  # ring: UnknownSegment (its message follows on the socket)
                c.copy_many([seg.va + 64], [seg.va + 128], [8])  # a vector: the socket
                c.copy(seg.va, seg.va + 8, 1 << 63)  # socket (behind the vector): OutOfBounds
            with pytest.raises(transfer.TransferError) as info:
                c.fence(timeout=TIMEOUT)
            assert type(info.value) is transfer.UnknownSegment, f"trial {trial}: fence raised {info.value!r}"


def test_trio_waits_inside_a_batch_like_the_blocking_client(daemon) -> None:  # type: ignore[no-untyped-def]
    """The blocking client sends what batch() holds before it waits (fence or result()); the trio one must too."""

    async def main() -> None:
        async with transfer.open_client(daemon.endpoint) as c:
            seg = await c.segment(4096)
            with trio.fail_after(2):
                with c.batch():
                    c.copy(seg.va, seg.va + 64, 8)
                    await c.fence()

    trio.run(main)


def test_a_size_outside_u64_is_the_same_error_on_every_path(daemon) -> None:  # type: ignore[no-untyped-def]
    got = {}
    for ring in (False, True):
        with transfer.connect(daemon.endpoint, ring=ring) as c:
            seg = c.segment(64)
            for n in (1 << 64, -1):
                for batched in (False, True):
                    try:
                        with c.batch() if batched else contextlib.nullcontext():
                            p = c.copy(seg.va, seg.va, n)
                        p.result(5)
                        got[(ring, n, batched)] = ("ok", "")
                    except Exception as exc:
                        got[(ring, n, batched)] = (type(exc).__name__, str(exc))
    for n in (1 << 64, -1):
        outcomes = {k: v for k, v in got.items() if k[1] == n}
        assert len(set(outcomes.values())) == 1, outcomes


@pytest.mark.parametrize("ring", [False, True])
def test_one_unencodable_request_does_not_lose_its_batch(daemon, ring: bool) -> None:  # type: ignore[no-untyped-def]
    with transfer.connect(daemon.endpoint, ring=ring) as c:
        seg = c.segment(64)
        seg.buffer[8:16] = 7
        with contextlib.suppress(Exception):
            with c.batch():
                good = c.copy(seg.va, seg.va + 8, 8)
                c.copy(seg.va, seg.va, 1 << 64)  # not a u64
        assert good.result(2) is None  # today: RequestTimeout, and the copy never ran
        assert (seg.buffer[:8] == 7).all()


def test_an_unencodable_compute_fails_alone(daemon) -> None:  # type: ignore[no-untyped-def]
    """A param msgpack cannot carry fails its own request; the rest of the batch still runs."""
    with transfer.connect(daemon.endpoint) as c:
        seg = c.segment(4096)
        seg.buffer[8:16] = 7
        x = seg.tensor((4,), np.float32, offset=1024)
        with c.batch():
            good = c.copy(seg.va, seg.va + 8, 8)
            bad = c.compute("scale_add", [x], [x], {"a": object(), "b": 0.0})
        assert good.result(5) is None and (seg.buffer[:8] == 7).all()
        with pytest.raises(transfer.InvalidField, match="cannot be encoded"):
            bad.result(5)
