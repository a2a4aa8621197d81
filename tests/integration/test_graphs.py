"""Graphs through a real daemon: defined once, run by VA, checked against NumPy and against the
same operators run one request at a time; every refusal from the wire, with the daemon serving on."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import transfer
from transfer import errors as E
from transfer import protocol as P
from transfer.kernels import GraphNode, graph_wire, parse_graph
from transfer.server._placement import CostPlacement, VirtualDevice
from transfer.testing import DaemonProcess, start_daemon

from conftest import FAST

RNG = np.random.default_rng(11)


@pytest.fixture(scope="module")
def gdaemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """Two CPU devices and a small per-session device quota (for the over-quota refusal)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("shm")
    shm = Path(tempfile.mkdtemp(prefix="transfer-graphs-", dir=base))  # (a name nobody can guess: mode 0700)
    wd = tmp_path_factory.mktemp("run")
    wd.chmod(0o700)
    d = start_daemon([*FAST, "--devices", "2", "--max-device-bytes-per-session", "64M"], workdir=wd, shm_dir=shm)
    try:
        yield d
    finally:
        d.stop()
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()


@pytest.fixture
def client(gdaemon: DaemonProcess) -> Iterator[transfer.Client]:
    with transfer.connect(gdaemon.endpoint) as c:
        yield c


def weights(c: transfer.Client, *arrays: np.ndarray) -> list[transfer.TensorRef]:
    """Arrays copied into one device buffer; their tensor references there."""
    total = sum(a.nbytes for a in arrays)
    seg, buf = c.segment(total), c.alloc(total)
    refs, off = [], 0
    for a in arrays:
        seg.ndarray(a.shape, a.dtype, offset=off)[...] = a
        refs.append(buf.tensor(a.shape, a.dtype, offset=off))
        off += a.nbytes
    c.copy(buf, seg).result()
    c.free(seg)
    return refs


def mlp(c: transfer.Client, batch: int, sizes: list[int], dtype: str = "float32") -> tuple[transfer.Graph, list[np.ndarray]]:
    """A linear/relu/.../linear graph and its weights."""
    ws = []
    for k in range(len(sizes) - 1):
        ws += [(RNG.standard_normal((sizes[k + 1], sizes[k])) / np.sqrt(sizes[k])).astype(dtype),
               RNG.standard_normal(sizes[k + 1]).astype(dtype)]
    refs = weights(c, *ws)
    g = c.graph()
    g.input("x", (batch, sizes[0]), dtype)
    prev = "x"
    for k in range(len(sizes) - 1):
        g.weight(f"w{k}", refs[2 * k])
        g.weight(f"b{k}", refs[2 * k + 1])
        last = k == len(sizes) - 2
        h = g.output("y", (batch, sizes[k + 1]), dtype) if last else g.tensor(f"h{k}", (batch, sizes[k + 1]), dtype)
        g.op("linear", [prev, f"w{k}", f"b{k}"], h)
        if not last:
            prev = g.tensor(f"a{k}", (batch, sizes[k + 1]), dtype)
            g.op("relu", [h], prev)
    return g, ws


def mlp_ref(x: np.ndarray, ws: list[np.ndarray]) -> np.ndarray:
    h = x.astype(np.float64)
    for k in range(0, len(ws), 2):
        h = h @ ws[k].T.astype(np.float64) + ws[k + 1]
        if k + 2 < len(ws):
            h = np.maximum(h, 0)
    return h


def test_mlp_graph_matches_numpy_and_profiles(client: transfer.Client) -> None:
    g, ws = mlp(client, 16, [32, 24, 24, 8])
    xs, ys = client.segment(16 * 32 * 4), client.segment(16 * 8 * 4)
    x = xs.ndarray((16, 32), np.float32)
    for _ in range(3):  # the definition travels once; later runs carry only VAs
        x[...] = RNG.standard_normal((16, 32))
        assert client.run_graph(g, [xs], [ys]).result() is None
        np.testing.assert_allclose(ys.ndarray((16, 8), np.float32), mlp_ref(x, ws), rtol=1e-4, atol=1e-4)
    # A run with one input and one output is one ring descriptor (the first, which carried
    # the definition, took the socket); a profiled run's answer does not fit a completion.
    assert client._ring is not None and client._ring.graphs
    pushed = client._ring.pushed
    run = client.run_graph(g, [xs], [ys])
    assert run.id in client._ring.outstanding and client._ring.pushed == pushed + 1
    assert run.result() is None
    prof = client.run_graph(g, [xs], [ys], profile=True)
    assert prof.id not in client._ring.outstanding and client._ring.pushed == pushed + 1
    prof = prof.result()
    nodes = prof.nodes
    assert [n.op for n in nodes] == ["linear", "relu", "linear", "relu", "linear"]
    assert all(n.device == client.home_device and n.kind == "cpu" and n.us >= 0 for n in nodes)
    assert nodes[0].kernel == "(float32, float32, float32) -> (float32)"
    assert client.stats()["session"]["defines"] >= 1


@pytest.mark.parametrize("flavor", ["sync", "trio"])
def test_a_pipelined_producer_runs_on_the_ring_from_its_second_run(gdaemon: DaemonProcess, flavor: str) -> None:
    """A producer that keeps four runs in flight from its first one (which carries the graph's
    definition over the socket) and never drains: every later run is one ring descriptor,
    placed behind the socket frames sent before it, and every output is right. (Before
    `FLAG_AFTER`, such a producer found a socket request pending at every submission, and
    all its runs stayed on the socket.)"""
    n, depth = 24, 4
    inputs = [RNG.standard_normal((8, 16)).astype(np.float32) for _ in range(n)]

    def outputs_right(c: transfer.Client | transfer.TrioClient, ws: list[np.ndarray], ys: list, pushed: int) -> None:
        assert c._ring is not None and c._ring.pushed == pushed + n - 1, "a run after the first took the socket"
        for k in range(depth):
            i = n - depth + k
            np.testing.assert_allclose(ys[i % depth].ndarray((8, 4), np.float32), mlp_ref(inputs[i], ws), rtol=1e-4, atol=1e-4)

    if flavor == "sync":
        with transfer.connect(gdaemon.endpoint) as c:
            g, ws = mlp(c, 8, [16, 12, 4])
            xs = [c.segment(8 * 16 * 4) for _ in range(depth)]
            ys = [c.segment(8 * 4 * 4) for _ in range(depth)]
            assert c._ring is not None
            pushed, runs = c._ring.pushed, []
            for i in range(n):
                if len(runs) == depth:
                    runs.pop(0).result(10)
                xs[i % depth].ndarray((8, 16), np.float32)[...] = inputs[i]
                runs.append(c.run_graph(g, [xs[i % depth]], [ys[i % depth]]))
            for r in runs:
                r.result(10)
            outputs_right(c, ws, ys, pushed)
        return

    async def main() -> None:
        async with transfer.open_client(gdaemon.endpoint) as c:
            ws = [(RNG.standard_normal((12, 16)) / 4).astype(np.float32), RNG.standard_normal(12).astype(np.float32),
                  (RNG.standard_normal((4, 12)) / 4).astype(np.float32), RNG.standard_normal(4).astype(np.float32)]
            total = sum(w.nbytes for w in ws)
            seg, buf = await c.segment(total), await c.alloc(total)
            refs, off = [], 0
            for w in ws:
                seg.ndarray(w.shape, w.dtype, offset=off)[...] = w
                refs.append(buf.tensor(w.shape, w.dtype, offset=off))
                off += w.nbytes
            await c.copy(buf, seg)
            g = c.graph()
            g.input("x", (8, 16), "float32")
            g.weight("w0", refs[0]), g.weight("b0", refs[1]), g.weight("w1", refs[2]), g.weight("b1", refs[3])
            h, a = g.tensor("h", (8, 12), "float32"), g.tensor("a", (8, 12), "float32")
            g.op("linear", ["x", "w0", "b0"], h)
            g.op("relu", [h], a)
            g.op("linear", [a, "w1", "b1"], g.output("y", (8, 4), "float32"))
            xs = [await c.segment(8 * 16 * 4) for _ in range(depth)]
            ys = [await c.segment(8 * 4 * 4) for _ in range(depth)]
            assert c._ring is not None
            pushed, runs = c._ring.pushed, []
            for i in range(n):
                if len(runs) == depth:
                    await runs.pop(0)
                xs[i % depth].ndarray((8, 16), np.float32)[...] = inputs[i]
                runs.append(c.run_graph(g, [xs[i % depth]], [ys[i % depth]]))
            for r in runs:
                await r
            outputs_right(c, ws, ys, pushed)

    trio.run(main)


@pytest.fixture
def socket_client(gdaemon: DaemonProcess) -> Iterator[transfer.Client]:
    """A client without a ring: every run is the Python pass's (planned, placed, sent to a device)."""
    with transfer.connect(gdaemon.endpoint, ring=False) as c:
        yield c


def test_a_graph_run_is_one_unit_of_device_work(socket_client: transfer.Client) -> None:
    """Its nodes' waves all run on one device: one message to the CPU device's process (one
    hop to a GPU's worker) runs them all (each node's work is over inline_bytes, so each wave
    once took a hop of its own)."""
    client = socket_client
    g, ws = mlp(client, 64, [256, 512, 512, 16])
    xs, ys = client.segment(64 * 256 * 4), client.segment(64 * 16 * 4)
    x = xs.ndarray((64, 256), np.float32)
    x[...] = RNG.standard_normal((64, 256))
    client.run_graph(g, [xs], [ys]).result()

    def calls() -> int:
        return client.stats()["daemon"]["devices"][client.home_device]["batches"]

    before = calls()
    for _ in range(3):
        client.run_graph(g, [xs], [ys]).result()
    assert calls() - before == 3
    np.testing.assert_allclose(ys.ndarray((64, 16), np.float32), mlp_ref(x, ws), rtol=1e-4, atol=1e-4)


def test_cpu_passes_are_pipelined(client: transfer.Client) -> None:
    """Runs submitted back to back on a CPU device: its process runs one pass while the loop
    plans the next (pipelined_passes counts them); every run's output is its own batch's."""
    g, ws = mlp(client, 64, [256, 512, 512, 16])
    n, nin, nout = 12, 64 * 256 * 4, 64 * 16 * 4
    xs, ys = client.segment(n * nin), client.segment(n * nout)
    x = xs.ndarray((n, 64, 256), np.float32)
    x[...] = RNG.standard_normal((n, 64, 256))
    before = client.stats()["daemon"]["pipelined_passes"]
    pending = [client.run_graph(g, [xs.va + i * nin], [ys.va + i * nout]) for i in range(n)]
    assert [p.result() for p in pending] == [None] * n
    y = ys.ndarray((n, 64, 16), np.float32)
    for i in range(n):
        np.testing.assert_allclose(y[i], mlp_ref(x[i], ws), rtol=1e-4, atol=1e-4)
    assert client.stats()["daemon"]["pipelined_passes"] > before


def test_dag_with_two_branches(client: transfer.Client) -> None:
    n = 12
    g = client.graph()
    g.input("x", (n, n), "float64")
    g.tensor("a", (n, n), "float64")
    g.tensor("b", (n, n), "float64")
    g.output("y", (n, n), "float64")
    g.output("s", (n,), "float64")
    g.op("relu", ["x"], "a")
    g.op("scale_add", ["x"], "b", {"a": -2.0, "b": 0.5})
    g.op("matmul", ["a", "b"], "y")
    g.op("sum", ["b"], "s", {"axis": 0})
    xs, ys, ss = client.segment(n * n * 8), client.segment(n * n * 8), client.segment(n * 8)
    x = xs.ndarray((n, n), np.float64)
    x[...] = RNG.standard_normal((n, n))
    client.run_graph(g, [xs], [ys, ss]).result()
    b = x * -2.0 + 0.5
    np.testing.assert_allclose(ys.ndarray((n, n), np.float64), np.maximum(x, 0) @ b, rtol=1e-12)
    np.testing.assert_allclose(ss.ndarray((n,), np.float64), b.sum(axis=0), rtol=1e-12)


# A chain of shape-preserving operators: (name, params).
_UNARY = st.sampled_from([("relu", {}), ("gelu", {}), ("gelu", {"approximate": "tanh"}), ("softmax", {}),
                          ("scale_add", {"a": 0.5, "b": 1.0}), ("scale_add", {"a": -1.5})])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chain=st.lists(_UNARY, min_size=1, max_size=5), rows=st.integers(1, 9), cols=st.integers(1, 9),
       dtype=st.sampled_from(["float32", "float64", "float16"]))
def test_graph_equals_its_operators_one_by_one(client: transfer.Client, chain, rows: int, cols: int, dtype: str) -> None:
    """A graph run leaves exactly the bytes its operators leave run one request at a time."""
    nb = rows * cols * np.dtype(dtype).itemsize
    xs = client.segment(nb)
    x = xs.ndarray((rows, cols), dtype)
    x[...] = RNG.standard_normal((rows, cols))
    g = client.graph()
    g.input("x", (rows, cols), dtype)
    prev = "x"
    for k, (op, params) in enumerate(chain):
        name = g.output("y", (rows, cols), dtype) if k == len(chain) - 1 else g.tensor(f"t{k}", (rows, cols), dtype)
        g.op(op, [prev], name, params)
        prev = name
    ys, again = client.segment(nb), client.segment(nb)
    client.run_graph(g, [xs], [ys]).result()  # planned (in place where a node can be: `parse_graph`)
    client.run_graph(g, [xs], [again]).result()  # kept, and on a ring its worker's
    # The same operators, each its own compute request, intermediates in client buffers.
    bufs = [client.alloc(nb) for _ in chain]
    src = xs.tensor((rows, cols), dtype)
    for (op, params), buf in zip(chain, bufs):
        dst = buf.tensor((rows, cols), dtype)
        client.compute(op, [src], [dst], params)
        src = dst
    zs = client.segment(nb)
    client.copy(zs, bufs[-1], nb).result()
    assert ys.ndarray((rows, cols), dtype).tobytes() == zs.ndarray((rows, cols), dtype).tobytes()
    assert again.ndarray((rows, cols), dtype).tobytes() == zs.ndarray((rows, cols), dtype).tobytes()
    for b in bufs:
        client.free(b)
    client.free(g)
    for s in (xs, ys, zs, again):
        client.free(s)


def test_graph_memory_is_counted_and_freed(daemon: DaemonProcess) -> None:
    client = transfer.connect(daemon.endpoint)

    def device_bytes() -> int:
        return client.stats()["daemon"]["device_bytes"]

    before = device_bytes()
    g = client.graph()
    g.input("x", (256, 256), "float32")
    g.tensor("h", (256, 256), "float32")
    g.output("y", (256, 256), "float32")
    g.op("relu", ["x"], "h")
    g.op("gelu", ["h"], "y")
    xs = client.segment(256 * 256 * 4)
    ys = client.segment(256 * 256 * 4)
    client.run_graph(g, [xs], [ys]).result()
    assert device_bytes() == before + 256 * 256 * 4  # one intermediate
    client.free(g)
    assert device_bytes() == before
    # ... and with the session.
    with transfer.connect(daemon.endpoint) as other:
        g2 = other.graph()
        g2.input("x", (4,), "float32")
        g2.tensor("h", (1 << 20,), "float32")
        g2.output("y", (4,), "float32")
        g2.op("relu", ["x"], "y")
        g2.op("fill", [], "h", {"value": 1})
        s = other.segment(16)
        t = other.segment(16)
        other.run_graph(g2, [s], [t]).result()
        assert device_bytes() == before + (4 << 20)
    deadline = time.monotonic() + 5  # a closed session is released after its Close is answered
    while device_bytes() != before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert device_bytes() == before
    client.close()


def test_placement_overrides_per_graph(client: transfer.Client) -> None:
    """A node whose operands are all host memory goes where the graph's policy says."""
    g = client.graph(placement="round-robin")
    g.input("x", (8,), "float32")
    g.output("y", (8,), "float32")
    g.op("relu", ["x"], "y")
    xs, ys = client.segment(32), client.segment(32)
    seen = {client.run_graph(g, [xs], [ys], profile=True).result().nodes[0].device for _ in range(4)}
    assert seen == {0, 1}
    pinned = client.graph(device=1)
    pinned.input("x", (8,), "float32")
    pinned.output("y", (8,), "float32")
    pinned.op("relu", ["x"], "y")
    assert client.run_graph(pinned, [xs], [ys], profile=True).result().nodes[0].device == 1


# --- refusals from the wire ---------------------------------------------------------------------
def _define(c: transfer.Client, d) -> tuple[int, object]:
    """A raw graph definition at a fresh arena VA; (va, the Define's outcome)."""
    mem = c._core.deferred.reserve(4096, -1, "test")  # an arena id, as Graph.prepare takes one
    try:
        return mem.va, c._call(P.Define, P.DEF_GRAPH, mem.va, 1, d, "test_graphs.py:1")
    except E.TransferError as exc:
        return mem.va, exc


def _wire(tensors, nodes, inputs=("x",), outputs=("y",), device=-1, placement=""):
    return graph_wire(tensors, [GraphNode(*n) for n in nodes], inputs, outputs, device, placement)


_X = ("x", "float32", [4, 4], None)
_Y = ("y", "float32", [4, 4], None)


@pytest.mark.parametrize("d, err, words", [
    (_wire([_X, _Y], [("relu", ("x",), ("z",), {})]), E.InvalidField, "unknown tensor 'z'"),
    (_wire([_X, _Y, ("h", "float32", [4, 4], None)], [("relu", ("h",), ("y",), {}), ("relu", ("x",), ("h",), {})]),
     E.InvalidField, "before any node writes it"),
    (_wire([_X, _Y], [("relu", ("y",), ("y",), {})]), E.InvalidField, "a cycle"),
    (_wire([_X, _Y, ("h", "float32", [4, 5], None)], [("relu", ("x",), ("h",), {}), ("relu", ("h",), ("y",), {})]),
     E.InvalidField, "relu"),
    (_wire([_X, _Y, ("h", "float64", [4, 4], None)], [("relu", ("x",), ("h",), {}), ("relu", ("h",), ("y",), {})]),
     E.InvalidField, "kernel"),
    (_wire([_X, _Y], [("nope", ("x",), ("y",), {})]), E.UnknownOperation, "nope"),
    (_wire([_X, _Y], [("relu", ("x",), ("y",), {}), ("gelu", ("x",), ("y",), {})]), E.InvalidField, "already written"),
    (_wire([_X, _Y], [("relu", ("x",), ("y",), {})], device=7), E.InvalidField, "device 7"),
    (_wire([_X, _Y, ("h", "float32", [1 << 26], None)], [("relu", ("x",), ("y",), {}), ("fill", (), ("h",), {"value": 0})]),
     E.QuotaExceeded, "quota"),
    (_wire([_X, _Y, ("w", "float32", [4, 4], (1 << 23) << 40)], [("matmul", ("x", "w"), ("y",), {})]), E.AddressError, "weight 'w'"),
    ([[], [], [], [], -1, ""], E.InvalidField, "nodes"),
    ("graph", E.InvalidField, "a graph is"),
])
def test_wire_refusals(client: transfer.Client, d, err, words: str) -> None:
    _, got = _define(client, d)
    assert isinstance(got, err), got
    assert words in str(got)
    client.fill(client.segment(8), 8, 1).result()  # the daemon serves on


def test_run_refusals(client: transfer.Client) -> None:
    g = client.graph()
    g.input("x", (4, 4), "float32")
    g.output("y", (4, 4), "float32")
    g.op("relu", ["x"], "y")
    xs, small = client.segment(64), client.segment(16)
    client.run_graph(g, [xs], [client.segment(64)]).result()
    with pytest.raises(E.OutOfBounds, match="node 0"):
        client.run_graph(g, [xs], [small]).result()
    with pytest.raises(E.InvalidField, match="takes 1 input"):
        client._call(P.RunGraph, g.va, [xs.va, xs.va], [small.va])
    with pytest.raises(E.InvalidField, match="not a graph"):
        client._call(P.RunGraph, xs.va, [xs.va], [small.va])
    with pytest.raises(E.UnknownSegment):
        client._call(P.RunGraph, 12345 << 40, [xs.va], [small.va])
    client.free(g)
    client.fence()
    with pytest.raises(E.AddressError):  # its arena id is free again: nothing is there
        client._call(P.RunGraph, g.va, [xs.va], [small.va])
    assert client.fill(xs, 64, 0).result() is None


def test_parse_graph_is_pure_and_lays_out_intermediates() -> None:
    spec = parse_graph(_wire([_X, _Y, ("h", "float32", [4, 4], None), ("w", "float32", [4, 4], 1 << 40)],
                             [("matmul", ("x", "w"), ("h",), {}), ("relu", ("h",), ("y",), {})]))
    assert spec.offsets == {"h": 0} and spec.scratch_nbytes == 256
    assert spec.deps == ((), (0,)) and spec.param_bytes() == 64


def _mid(name: str, dtype: str = "float32") -> tuple[str, str, list[int], None]:
    return (name, dtype, [4, 4], None)


def test_an_in_place_node_shares_its_input_s_memory_when_nothing_else_reads_it() -> None:
    w, b = ("w", "float32", [4, 4], 1 << 40), ("b", "float32", [4], (1 << 40) + 64)
    lin = ("linear", ("x", "w", "b"), ("h",), {})
    # linear -> h -> relu -> a -> gelu -> g -> linear -> y: h, a and g are one block
    spec = parse_graph(_wire([_X, _Y, w, b, _mid("h"), _mid("a"), _mid("g")],
                             [lin, ("relu", ("h",), ("a",), {}), ("gelu", ("a",), ("g",), {}),
                              ("linear", ("g", "w", "b"), ("y",), {})]))
    assert spec.offsets == {"g": 0, "h": 0, "a": 0} and spec.scratch_nbytes == 256
    assert spec.param_bytes() == 80
    # Each its own block: h is read twice; the relu writes a graph output; the dtypes differ;
    # the two nodes are placed differently.
    apart = [
        ([_X, _Y, w, b, _mid("h"), _mid("a")], [lin, ("relu", ("h",), ("a",), {}), ("linear", ("h", "w", "b"), ("a2",), {}),
                                                 ("linear", ("a", "w", "b"), ("y",), {})], [_mid("a2")]),
        ([_X, _Y, w, b, _mid("h")], [lin, ("relu", ("h",), ("y",), {})], []),
        ([_X, _Y, _mid("h", "float64"), _mid("a")],
         [("cast", ("x",), ("h",), {}), ("scale_add", ("h",), ("a",), {"a": 2.0}), ("relu", ("a",), ("y",), {})], []),
        ([_X, _Y, w, b, _mid("h"), _mid("a")], [lin, ("relu", ("h",), ("a",), {}, 0, "cost"),
                                                 ("linear", ("a", "w", "b"), ("y",), {})], []),
    ]
    for tensors, nodes, more in apart:
        spec = parse_graph(_wire(tensors + more, nodes))
        assert len(set(spec.offsets.values())) == len(spec.offsets), spec.offsets


def test_cost_placement() -> None:
    cpu, gpu = VirtualDevice(0, "cpu", None), VirtualDevice(1, "gpu", None)
    cost = CostPlacement()
    assert cost.choose([cpu, gpu], 4096, 4096) is cpu  # moving it costs more than computing it
    assert cost.choose([cpu, gpu], 64 << 20, 64 << 20) is gpu
    gpu.queued_bytes = 1 << 40  # a busy GPU loses
    assert cost.choose([cpu, gpu], 64 << 20, 64 << 20) is cpu


def test_mlp_graph_on_each_backend(backend_daemon: DaemonProcess) -> None:
    """The GPU path too (the stream simulation without a GPU): lanes, pipelined passes, sync."""
    with transfer.connect(backend_daemon.endpoint) as c:
        g, ws = mlp(c, 8, [16, 12, 4], "float32")
        xs, ys = c.segment(8 * 16 * 4), c.segment(8 * 4 * 4)
        x = xs.ndarray((8, 16), np.float32)
        for _ in range(3):
            x[...] = RNG.standard_normal((8, 16))
            prof = c.run_graph(g, [xs], [ys], profile=True).result()
            np.testing.assert_allclose(ys.ndarray((8, 4), np.float32), mlp_ref(x, ws), rtol=1e-4, atol=1e-4)
        assert {n.kind for n in prof.nodes} == {"cpu" if c.backend == "numpy" else "gpu"}


def test_a_graph_run_is_one_op(socket_client: transfer.Client) -> None:
    """Planned from its definition's layout, a one-device graph run is one op (one wave), not
    one per node plus one that answers; the outputs are still the math's."""
    client = socket_client
    g, ws = mlp(client, 8, [16, 12, 12, 4])
    xs, ys = client.segment(8 * 16 * 4), client.segment(8 * 4 * 4)
    x = xs.ndarray((8, 16), np.float32)
    x[...] = RNG.standard_normal((8, 16))
    client.run_graph(g, [xs], [ys]).result()

    def counters() -> tuple[int, int]:
        d = client.stats()["daemon"]
        return d["ops"], d["waves"]

    ops, waves = counters()
    for _ in range(3):
        client.run_graph(g, [xs], [ys]).result()
    assert counters() == (ops + 3, waves + 3)
    np.testing.assert_allclose(ys.ndarray((8, 4), np.float32), mlp_ref(x, ws), rtol=1e-4, atol=1e-4)


def test_a_device_process_run_leaves_the_bytes_of_its_operators_one_by_one(socket_client: transfer.Client) -> None:
    """Sent to the CPU device's process, an MLP run's linears and the relus sharing their
    blocks run fused there too (`kernels.fuse_steps`); the output is, byte for byte, the
    operators' sent one request at a time into buffers of their own."""
    c = socket_client
    g, ws = mlp(c, 8, [16, 12, 4])
    xs, ys, zs = c.segment(8 * 16 * 4), c.segment(8 * 4 * 4), c.segment(8 * 4 * 4)
    h, a = c.segment(8 * 12 * 4), c.segment(8 * 12 * 4)
    refs = weights(c, *ws)
    xs.ndarray((8, 16), np.float32)[...] = RNG.standard_normal((8, 16))
    c.run_graph(g, [xs], [ys]).result()
    c.compute("linear", [xs.tensor((8, 16), np.float32), refs[0], refs[1]], [h.tensor((8, 12), np.float32)])
    c.compute("relu", [h.tensor((8, 12), np.float32)], [a.tensor((8, 12), np.float32)])
    c.compute("linear", [a.tensor((8, 12), np.float32), refs[2], refs[3]], [zs.tensor((8, 4), np.float32)]).result()
    assert ys.ndarray((8, 4), np.float32).tobytes() == zs.ndarray((8, 4), np.float32).tobytes()


def test_a_repeated_run_plans_nothing_until_a_segment_goes(socket_client: transfer.Client) -> None:
    """A run with the VAs of an earlier one reuses its plan (counted): nothing is translated
    or placed again. New VAs are planned once; once any segment is freed, the next run plans
    again, so a freed output is refused, not written through a stale plan."""
    client = socket_client
    g, ws = mlp(client, 8, [16, 12, 12, 4])
    xs, ys, other = client.segment(8 * 16 * 4), client.segment(8 * 4 * 4), client.segment(8 * 4 * 4)
    x = xs.ndarray((8, 16), np.float32)
    x[...] = RNG.standard_normal((8, 16))

    def reused() -> int:
        return int(client.stats()["daemon"]["graph_plans_reused"])

    client.run_graph(g, [xs], [ys]).result()
    before = reused()
    for _ in range(5):
        client.run_graph(g, [xs], [ys]).result()
    assert reused() == before + 5
    client.run_graph(g, [xs], [other]).result()  # new VAs: planned
    client.run_graph(g, [xs], [other]).result()
    assert reused() == before + 6
    np.testing.assert_allclose(other.ndarray((8, 4), np.float32), mlp_ref(x, ws), rtol=1e-4, atol=1e-4)
    client.free(other)
    with pytest.raises(E.SegmentFreed):
        client.run_graph(g, [xs], [other]).result()
    client.run_graph(g, [xs], [ys]).result()  # planned again after the free, then reused
    client.run_graph(g, [xs], [ys]).result()
    assert reused() == before + 7


def test_runs_revalidate_weights_and_bound_vas(client: transfer.Client) -> None:
    """What a definition fixed is not trusted blindly: a bound output overlapping a bound
    input is refused, a weight freed after the definition fails the run (naming the node
    that reads it), and the daemon serves on."""
    g = client.graph()
    g.input("x", (4, 4), "float32")
    g.tensor("h", (4, 4), "float32")
    g.output("y", (4, 4), "float32")
    wbuf = client.alloc(64)
    g.weight("w", wbuf.tensor((4, 4), "float32"))
    g.op("relu", ["x"], "h")
    g.op("matmul", ["h", "w"], "y")
    xs, ys = client.segment(64), client.segment(64)
    client.run_graph(g, [xs], [ys]).result()
    one = client.graph()
    one.input("x", (4, 4), "float32")
    one.output("y", (4, 4), "float32")
    one.weight("w", wbuf.tensor((4, 4), "float32"))
    one.op("matmul", ["x", "w"], "y")
    with pytest.raises(E.InvalidField, match="node 0 \\(matmul\\).*overlaps"):
        client.run_graph(one, [xs], [xs]).result()
    client.free(wbuf)
    client.fence()
    with pytest.raises(E.AddressError, match="node 1 \\(matmul\\)"):
        client.run_graph(g, [xs], [ys]).result()
    assert client.fill(xs, 64, 0).result() is None


def test_a_graph_runs_only_for_its_session(gdaemon: DaemonProcess) -> None:
    """Another session naming a graph's VA (on the ring, as any one-input run travels) is told
    it is not the owner, and the graph's owner runs it on as before."""
    with transfer.connect(gdaemon.endpoint) as a, transfer.connect(gdaemon.endpoint) as b:
        g = a.graph()
        g.input("x", (4, 4), "float32")
        g.output("y", (4, 4), "float32")
        g.op("relu", ["x"], "y")
        ax, ay = a.segment(64), a.segment(64)
        ax.ndarray((4, 4), np.float32)[...] = -1
        a.run_graph(g, [ax], [ay]).result()
        bx, by = b.segment(64), b.segment(64)
        assert b._ring is not None
        pushed = b._ring.pushed
        with pytest.raises(E.NotOwner):
            b._call(P.RunGraph, g.va, [bx.va], [by.va])
        assert b._ring.pushed == pushed + 1  # it took the ring
        ax.ndarray((4, 4), np.float32)[...] = 3
        a.run_graph(g, [ax], [ay]).result()
        np.testing.assert_array_equal(ay.ndarray((4, 4), np.float32), 3)
