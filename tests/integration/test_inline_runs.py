"""Graph runs a ring's worker runs itself (server/_inline.py, native/dataplane.c), and repeated
computes sent as one-node graphs (client/_computes.py).

The native part is tested on a bare worker with a Python runner (order, statuses, handovers);
the rest on a real daemon and real clients: a repeated run is the worker's (counted, nothing
planned), its outputs are each run's own, a freed operand is refused as before, and a repeated
compute becomes a graph the worker runs.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import trio

import transfer
from transfer import _native
from transfer import errors as E
from transfer.client import _computes
from transfer.ring import COMPLETION_DETAIL, REQUEST_DTYPE, Op, Ring
from transfer.ring._layout import OFF_CQ_DATA_W
from transfer.server._inline import InlineRuns
from transfer.testing import DaemonProcess

RNG = np.random.default_rng(7)
VA = 1 << 40  # segment 1, offset 0


# --- the worker and its runner -------------------------------------------------------------------
@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Any]:
    """A bare worker of session 5 over one 4 KiB host segment (id 1), and the client's end."""
    srv = Ring.create(tmp_path / "r", 16)
    cli = Ring.attach(tmp_path / "r")
    table = _native.Table()
    mem = np.zeros(4096, np.uint8)
    table.add(1, mem, 5)
    made: list[Any] = []

    class Rig:
        def __init__(self) -> None:
            self.mem, self.srv, self.cli, self.calls = mem, srv, cli, []

        def start(self, runner: Any) -> Any:
            w = _native.Worker(table, srv.inbox, srv.outbox, 5, -1, -1, 50e-6, (1e-5,), None, runner)
            made.append(w)
            return w

        def answers(self, n: int) -> list[tuple[int, ...]]:
            out = []
            while len(out) < n:
                assert self.cli.wait(timeout=10.0) >= 1, f"{len(out)} of {n} completions came"
                out.append(tuple(self.cli.pop()))
            return out

    try:
        yield Rig()
    finally:
        for w in made:
            w.stop()
        cli.close()
        srv.close()


def _descs(*rows: tuple[int, ...]) -> np.ndarray:
    a = np.zeros(len(rows), REQUEST_DTYPE)
    for i, r in enumerate(rows):
        a[i] = r + (0,) * (10 - len(r))
    return a


def _run(rid: int, graph: int, src: int = VA, dst: int = VA + 64, nbytes: int = 0) -> tuple[int, ...]:
    return (Op.RUN_GRAPH, rid, dst, src, nbytes, 3, 0, graph)


def test_the_worker_runs_graph_descriptors_in_ring_order(rig: Any) -> None:
    """A batch of copy, run, failing run, fill: each answered in order; the run sees the copy
    before it and its writes are there before the fill after it; a failing run's status
    carries COMPLETION_DETAIL (its message goes on the socket)."""
    mem = rig.mem
    mem[8:12] = [1, 2, 3, 4]

    def runner(rid: int, graph: int, src: int, dst: int, stream: int) -> int | None:
        rig.calls.append((rid, graph, src, dst, stream, bytes(mem[0:4])))
        mem[100] = mem[0] + 40
        return 0 if graph == 0xA else 7

    worker = rig.start(runner)
    rig.cli.push_many(_descs((Op.COPY, 1, VA, VA + 8, 4), _run(2, 0xA), _run(3, 0xB), (Op.FILL, 4, VA + 100, 0, 1, 0, 0, 9)))
    answers = rig.answers(4)
    assert [a[0] for a in answers] == [1, 2, 3, 4]
    assert [a[1] for a in answers] == [0, 0, 7, 0]
    assert answers[2][3] == COMPLETION_DETAIL and answers[1][3] == 0
    assert rig.calls[0] == (2, 0xA, VA, VA + 64, 3, b"\x01\x02\x03\x04")
    assert mem[100] == 9  # the fill came after both runs' writes
    assert worker.counters()["graph"] == 2 and worker.mode == _native.NATIVE


def test_a_run_the_runner_does_not_keep_is_handed_over(rig: Any) -> None:
    """None from the runner, an exception in it, or fields a RUN_GRAPH must not have: the
    descriptor goes to the Python pass (the worker stands aside), never answered here."""
    hooked: list[Any] = []
    old = sys.unraisablehook
    sys.unraisablehook = hooked.append

    def runner(rid: int, graph: int, src: int, dst: int, stream: int) -> int | None:
        rig.calls.append(rid)
        if graph == 0xE:
            raise RuntimeError("a bug in the runner")
        return None

    try:
        worker = rig.start(runner)
        for rid, desc, called in ((1, _run(1, 0xC), True), (2, _run(2, 0xE), True), (3, _run(3, 0xA, nbytes=8), False)):
            rig.cli.push_many(_descs(desc))
            deadline = time.monotonic() + 30  # (a bound for a broken build, not a wait: the flip follows the push)
            while worker.mode != _native.PYTHON and time.monotonic() < deadline:
                rig.srv.inbox.wait(1, 1.0)
            assert worker.why == "opcode"
            assert rig.srv.available() == 1 and rig.srv.pop()[1] == rid  # still there, for Python
            assert (rid in rig.calls) == called
            worker.resume()
    finally:
        sys.unraisablehook = old
    assert [type(h.exc_value) for h in hooked] == [RuntimeError]
    assert worker.counters()["graph"] == 0 and worker.counters()["handover_opcode"] == 3


def test_a_completion_for_a_sleeping_client_is_a_counted_wake(rig: Any, tmp_path: Path) -> None:
    """`rouses` (ring_client_wakes): a completion pushed while the client is asleep on its
    futex is a wake, counted; one the client takes without sleeping is not."""
    words = np.memmap(tmp_path / "r", np.uint32, "r", offset=OFF_CQ_DATA_W, shape=(1,))

    def runner(rid: int, graph: int, src: int, dst: int, stream: int) -> int | None:
        if graph == 0xA:  # answer once the client sleeps on its completions (a bound for a broken build)
            deadline = time.monotonic() + 30
            while not words[0] and time.monotonic() < deadline:
                time.sleep(0.001)
        return 0

    worker = rig.start(runner)
    for rid in (1, 2):  # taken without sleeping: polled
        rig.cli.push_many(_descs(_run(rid, 0xB)))
        deadline = time.monotonic() + 30
        while not rig.cli.available() and time.monotonic() < deadline:
            pass
        assert rig.cli.pop()[0] == rid
    assert worker.counters()["rouses"] == 0
    rig.cli.push_many(_descs(_run(3, 0xA)))
    assert rig.cli.wait(timeout=30.0, spin=0) >= 1 and rig.cli.pop()[0] == 3
    deadline = time.monotonic() + 30  # (counted just after the wake: the client may look first)
    while worker.counters()["rouses"] < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert worker.counters()["rouses"] == 1


def test_an_inline_failure_is_answered_with_its_error_from_the_loop() -> None:
    """The runner answers a failing node's error code at once and hands the error to the loop
    (`report`), which sends its message; a run it does not keep is None."""
    runs = InlineRuns()
    reported: list[tuple[Any, int, E.TransferError]] = []
    runs.report = lambda session, rid, err: reported.append((session, rid, err))

    class Session:
        id, running, worker = 9, True, None
        stats = SimpleNamespace(device_ns=0)

    session = Session()
    bad = E.InvalidField("node 1 (relu): no")
    runs.keep(9, 0xA, 1, 2, lambda worker: (0.25, bad))
    runs.keep(9, 0xB, 1, 2, lambda worker: (0.5, None))

    async def main() -> list[Any]:
        run = runs.runner(session)
        assert run is not None
        out = [run(11, 0xA, 1, 2, 0), run(12, 0xB, 1, 2, 0), run(13, 0xC, 1, 2, 0)]
        await trio.lowlevel.checkpoint()  # (the report runs on the loop)
        return out

    assert trio.run(main) == [bad.code, 0, None]
    assert reported == [(session, 11, bad)]
    assert session.stats.device_ns == 750_000_000  # the kernels' time: the session's device time
    runs.clear()
    assert runs.kept == {} and runs.runner(session) is None  # (outside a trio run: no runner)


def test_a_cpu_run_whose_node_fails_is_run_again_node_by_node_for_its_error() -> None:
    """The NumPy backend's bound run calls its kernels straight through; when one raises, it
    runs the stretch again through `run_steps`, which names the node and skips what read it."""
    from transfer.addressing import SegmentKind
    from transfer.backends import Span
    from transfer.backends._numpy import NumpyBackend
    from transfer.kernels import REGISTRY, TensorRef

    mem = bytearray(64)
    t = TensorRef(0, "float32", (4,))
    x, h, y = (Span(SegmentKind.DEVICE, mem, off, 16) for off in (0, 16, 32))
    np.frombuffer(mem, np.float32, 4)[:] = [-1, 2, -3, 4]
    relu = REGISTRY.lookup("relu", ("float32", "float32"), "cpu")
    calls = []

    class Flaky:
        op, sig = "relu", ("float32", "float32")

        def run(self, ins: Any, outs: Any, params: Any, xp: Any) -> None:
            calls.append(1)
            raise MemoryError("no room")

    steps = [(0, relu, [(t, x)], [(t, h)], {}, (), "relu"), (1, Flaky(), [(t, h)], [(t, y)], {}, (0,), "flaky"),
             (2, relu, [(t, y)], [(t, x)], {}, (1,), "relu")]
    worker = SimpleNamespace(device_wait=lambda: None)
    bound = NumpyBackend.inline_steps(None, steps, 0, {})  # type: ignore[arg-type]  (it uses nothing of the backend)
    seconds, err = bound(worker)
    assert isinstance(err, E.TransferError) and "no room" in str(err) and seconds >= 0
    assert len(calls) == 2  # once straight through, once node by node
    assert np.frombuffer(mem, np.float32, 4, 16).tolist() == [0, 2, 0, 4]  # the first node ran
    assert np.frombuffer(mem, np.float32, 4, 0).tolist() == [-1, 2, -3, 4]  # the third, skipped, did not


# --- a daemon ----------------------------------------------------------------------------------
@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[transfer.Client]:
    with transfer.connect(daemon.endpoint) as c:
        assert c.ring
        yield c


def _mlp(c: transfer.Client, batch: int) -> tuple[transfer.Graph, list[np.ndarray]]:
    sizes = [16, 12, 4]
    ws = [RNG.standard_normal((sizes[k + 1], sizes[k])).astype(np.float32) for k in range(2)]
    bs = [RNG.standard_normal(sizes[k + 1]).astype(np.float32) for k in range(2)]
    total = sum(a.nbytes for a in (*ws, *bs))
    seg, buf = c.segment(total), c.alloc(total)
    refs, off = [], 0
    for a in (ws[0], bs[0], ws[1], bs[1]):
        seg.ndarray(a.shape, np.float32, offset=off)[...] = a
        refs.append(buf.tensor(a.shape, np.float32, offset=off))
        off += a.nbytes
    c.copy(buf, seg, total).result()
    g = c.graph()
    g.input("x", (batch, 16), np.float32)
    g.output("y", (batch, 4), np.float32)
    g.tensor("h", (batch, 12), np.float32)
    g.tensor("a", (batch, 12), np.float32)
    for k, r in enumerate(refs):
        g.weight(f"w{k}", r)
    g.op("linear", ["x", "w0", "w1"], "h")
    g.op("relu", ["h"], "a")
    g.op("linear", ["a", "w2", "w3"], "y")
    return g, [ws[0], bs[0], ws[1], bs[1]]


def _ref(x: np.ndarray, p: list[np.ndarray]) -> np.ndarray:
    return np.maximum(x @ p[0].T + p[1], 0) @ p[2].T + p[3]


def _counts(c: transfer.Client) -> tuple[int, int, int]:
    d = c.stats()["daemon"]
    return d["native_graph_runs"], d["graph_plans_reused"], d["ops"]


def test_a_repeated_ring_run_is_the_workers(client: transfer.Client) -> None:
    """From its second run on, a run with the same VAs is the ring worker's: counted there,
    nothing planned or sent to a device, and each run's output is its own input's."""
    g, p = _mlp(client, 8)
    xs, ys = client.segment(8 * 16 * 4), client.segment(8 * 4 * 4)
    x, y = xs.ndarray((8, 16), np.float32), ys.ndarray((8, 4), np.float32)
    x[...] = RNG.standard_normal((8, 16))
    client.run_graph(g, [xs], [ys]).result()
    runs, reused, ops = _counts(client)
    for _ in range(5):
        x[...] = RNG.standard_normal((8, 16))
        client.run_graph(g, [xs], [ys]).result()
        np.testing.assert_allclose(y, _ref(x, p), rtol=1e-4, atol=1e-4)
    after = _counts(client)
    assert after[0] == runs + 5 and after[1] == reused
    assert client.stats()["session"]["device_ns"] > 0  # the kernels' time, the session's device time
    assert after[2] - ops <= 1  # (the stats request's own pass at most: no run was an op)


def test_the_worker_s_fused_run_leaves_the_bytes_of_its_operators_one_by_one(client: transfer.Client) -> None:
    """On the worker, the linear and the relu that shares its block run as one step (the bias
    and the relu in one native pass: `kernels.fuse_steps`); its output is, byte for byte, the
    three operators' run as compute requests (NaN included)."""
    g, p = _mlp(client, 8)
    xs, ys, zs = client.segment(8 * 16 * 4), client.segment(8 * 4 * 4), client.segment(8 * 4 * 4)
    h, a = client.segment(8 * 12 * 4), client.segment(8 * 12 * 4)
    wseg = client.segment(sum(w.nbytes for w in p))
    refs, off = [], 0
    for w in p:
        wseg.ndarray(w.shape, np.float32, offset=off)[...] = w
        refs.append(wseg.tensor(w.shape, np.float32, offset=off))
        off += w.nbytes
    x = xs.ndarray((8, 16), np.float32)
    client.run_graph(g, [xs], [ys]).result()  # (planned: later runs are the worker's)
    for values in (RNG.standard_normal((8, 16)), np.where(RNG.random((8, 16)) < 0.5, -0.0, np.nan)):
        x[...] = values
        runs = client.stats()["daemon"]["native_graph_runs"]
        client.run_graph(g, [xs], [ys]).result()
        assert client.stats()["daemon"]["native_graph_runs"] == runs + 1
        client.compute("linear", [xs.tensor((8, 16), np.float32), refs[0], refs[1]], [h.tensor((8, 12), np.float32)])
        client.compute("relu", [h.tensor((8, 12), np.float32)], [a.tensor((8, 12), np.float32)])
        client.compute("linear", [a.tensor((8, 12), np.float32), refs[2], refs[3]], [zs.tensor((8, 4), np.float32)]).result()
        assert ys.ndarray((8, 4), np.float32).tobytes() == zs.ndarray((8, 4), np.float32).tobytes()


def test_a_learned_wait_for_a_run_naps_and_is_never_woken(client: transfer.Client) -> None:
    """A wait for a run of a graph whose waits the client knows naps with its futex word
    unset: a run that ends during the nap is taken when the nap ends, with no wake from the
    worker (`ring_client_wakes`), and the estimate shrinks (it slept too long)."""
    g, p = _mlp(client, 8)
    xs, ys = client.segment(8 * 16 * 4), client.segment(8 * 4 * 4)
    x, y = xs.ndarray((8, 16), np.float32), ys.ndarray((8, 4), np.float32)
    for _ in range(3):  # (the worker's from the second)
        x[...] = RNG.standard_normal((8, 16))
        client.run_graph(g, [xs], [ys]).result()
    naps = client._naps
    wakes = client.stats()["daemon"]["ring_client_wakes"]
    naps.estimate[g.va] = 0.2  # as if its waits took 0.2 s: the next ones nap through the run
    for _ in range(20):  # (a wait the heartbeat's reap finished first learns nothing: go on until one napped)
        x[...] = RNG.standard_normal((8, 16))
        p_ = client.run_graph(g, [xs], [ys])
        plan = naps.plan(p_.id)
        assert plan is not None and plan[1] > 0.05
        naps.ran(p_.id, g.va)  # (plan() took it: give it back for the wait)
        p_.result()
        np.testing.assert_allclose(y, _ref(x, p), rtol=1e-4, atol=1e-4)
        if naps.estimate[g.va] < 0.2:
            break
    assert client.stats()["daemon"]["ring_client_wakes"] == wakes
    assert naps.estimate[g.va] == pytest.approx(0.2 * 0.75)  # it slept too long: the estimate shrank


def test_a_freed_operand_is_refused_after_the_worker_ran(client: transfer.Client) -> None:
    """A free anywhere drops what the workers keep: the next run is planned again, so a freed
    output is refused with the error a request gets, and the session serves on."""
    g, p = _mlp(client, 8)
    xs, ys, other = client.segment(8 * 16 * 4), client.segment(8 * 4 * 4), client.segment(8 * 4 * 4)
    x = xs.ndarray((8, 16), np.float32)
    x[...] = RNG.standard_normal((8, 16))
    for _ in range(3):
        client.run_graph(g, [xs], [other]).result()
    runs = _counts(client)[0]
    assert runs >= 2
    client.free(other)
    with pytest.raises(E.SegmentFreed):
        client.run_graph(g, [xs], [other]).result()
    for _ in range(3):
        client.run_graph(g, [xs], [ys]).result()
    np.testing.assert_allclose(ys.ndarray((8, 4), np.float32), _ref(x, p), rtol=1e-4, atol=1e-4)
    # (how many of these the worker ran depends on when the loop hands the ring back after the
    # refusal: the first is always planned again, and a kept run is the worker's once it has it)


def test_a_repeated_compute_becomes_a_graph_the_worker_runs(client: transfer.Client) -> None:
    """The first call is a compute (its mistakes reported as a compute's); the second defines
    a one-node graph; from the third on the worker runs it. Every call's output is right, and
    a compute that answers a value (no outputs) stays a compute."""
    seg, out = client.segment(256), client.segment(256)
    src, dst = seg.tensor(64, np.float32), out.tensor(64, np.float32)
    x, y = seg.ndarray(64, np.float32), out.ndarray(64, np.float32)
    with pytest.raises(E.InvalidField, match="scale_add"):
        client.compute("scale_add", [src], [out.tensor(32, np.float32)], {"a": 2.0, "b": 1.0}).result()
    before = _counts(client)[0]
    for k in range(6):
        x[...] = RNG.standard_normal(64)
        assert client.compute("scale_add", [src], [dst], {"a": 2.0, "b": 1.0}).result() is None
        np.testing.assert_allclose(y, 2 * x + 1, rtol=1e-6)
    assert _counts(client)[0] == before + 4
    assert client.compute("checksum", [src], []).result() == client.compute("checksum", [src], []).result() == transfer.checksum64(x)


def test_compute_graphs_are_bounded_and_give_their_ids_back(client: transfer.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """More distinct repeated computes than the client keeps: the least recently used graph is
    freed on the daemon, so neither the arena nor the daemon's segments grow without bound."""
    monkeypatch.setattr(_computes, "KEPT", 4)
    seg, out = client.segment(4096), client.segment(4096)

    def segments() -> int:
        return int(client.stats()["session"]["segments"])

    base = segments()
    for n in range(1, 11):
        ins, outs = seg.tensor(n, np.float32), out.tensor(n, np.float32)
        for _ in range(3):
            client.compute("relu", [ins], [outs]).result()
        assert segments() <= base + 4
    np.testing.assert_array_equal(out.ndarray(10, np.float32), np.maximum(seg.ndarray(10, np.float32), 0))
    client.fence()
    assert segments() <= base + 4
