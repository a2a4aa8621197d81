"""Smoke tests of ``transfer-bench`` at tiny sizes (a few seconds each).

They run the real CLI in a subprocess (as a user would), with every method
and the embedded daemon when the core is importable, and check: exit status,
the JSON document, the plot, that a checksum mismatch fails the run, and that
nothing is left behind (processes, /dev/shm files, daemon segments).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # (the benchmark tools, run small: `pytest -m slow`, which CI runs after the default suite)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--reps", "1", "--rep-seconds", "0.05", "--warmup-seconds", "0.02", "--no-progress"]


def _transfer_ok() -> bool:
    from transfer._bench.runner import transfer_available

    return transfer_available()[0]


def _nixl_ok() -> bool:
    from transfer._bench.runner import mode_available

    return mode_available("remote")[0]


def _methods(with_transfer: bool) -> str:
    """Every method of the local/compute modes (nixl-raw is the remote mode's baseline) whose
    package is installed (iceoryx2, torch-mp: the others are skipped with a note)."""
    from transfer._bench.common import METHODS_ALL, method_available

    return ",".join(m for m in METHODS_ALL if (with_transfer or not m.startswith("transfer")) and m != "nixl-raw"
                    and method_available(m)[0])


def _iceoryx2_ok() -> bool:
    from transfer._bench.common import method_available

    return method_available("iceoryx2")[0]


def _run(args: list[str], tmp: Path, timeout: float = 180,
         env_extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, str, Path]:
    tag = uuid.uuid4().hex
    shm_dir = Path(tempfile.mkdtemp(prefix="tb-test-", dir="/dev/shm"))
    env = {**os.environ, "TRANSFER_BENCH_TEST_TAG": tag, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    try:
        proc = subprocess.run([sys.executable, "-m", "transfer.cli.bench", *args, "--daemon-shm-dir", str(shm_dir)],
                              cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        leftovers = list(shm_dir.iterdir())
    finally:
        for p in shm_dir.iterdir():
            p.unlink()
        shm_dir.rmdir()
    assert leftovers == [], f"daemon segments left behind: {leftovers}"
    return proc, tag, shm_dir


def _assert_nothing_left(tag: str) -> None:
    psutil = pytest.importorskip("psutil")
    alive = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.environ().get("TRANSFER_BENCH_TEST_TAG") == tag:
                alive.append((p.pid, p.info["cmdline"]))
        except (psutil.Error, OSError):
            continue
    assert alive == [], f"processes left behind: {alive}"
    stale = [n for n in os.listdir("/dev/shm") if n.startswith("transfer-bench-")]
    assert not [n for n in stale if _is_ours(n)], stale


def _is_ours(name: str) -> bool:
    # transfer-bench-<pid>-<hex>-...: the coordinator pid is gone when the run is over
    try:
        pid = int(name.split("-")[2])
    except (IndexError, ValueError):
        return False
    return not os.path.exists(f"/proc/{pid}")


def test_full_preset_tiny_all_methods(tmp_path: Path) -> None:
    with_transfer = _transfer_ok()
    out = tmp_path / "r.json"
    png = tmp_path / "r.png"
    # One size: each size runs every method in every mode (the suite's slowest test); the
    # sweep over sizes is the same loop, exercised by the iceoryx2 and remote tests below.
    args = ["full", "--sizes", "64K", "--producers", "2", "--modes", "local,compute,remote,gpu",
            "--methods", _methods(with_transfer), "--verify-every", "1",
            "--json", str(out), "--plot", str(png), *TINY]
    # NIXL made unimportable: the remote mode must be skipped with a note, not fail.
    proc, tag, _ = _run(args, tmp_path, env_extra={"TRANSFER_NIXL_MODULE": "no_such_nixl_module"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_nothing_left(tag)
    assert "transfer.daemon.startup" not in proc.stderr  # the embedded daemon logs to its run folder, not through the progress

    doc = json.loads(out.read_text())
    m = doc["machine"]
    for key in ("cpu", "cores", "memory_bytes", "python", "numpy", "pyzmq", "transfer", "gpu"):
        assert key in m
    res = [r for r in doc["results"] if not r["method"].startswith("limit:")]
    expected_methods = set(_methods(with_transfer).split(","))
    assert {r["method"] for r in res} == expected_methods
    assert {r["mode"] for r in res} == {"local", "compute"}
    assert {r["size"] for r in res} == {65536}
    for r in res:
        for key in ("method", "mode", "size", "producers", "gbps", "rps", "p50_us", "p99_us",
                    "reps", "min_gbps", "max_gbps"):
            assert key in r, key
        assert r["gbps"] > 0 and r["rps"] > 0 and r["p99_us"] >= r["p50_us"] > 0
        assert r["min_gbps"] <= r["gbps"] <= r["max_gbps"]
        assert r["verified_groups"] == r["groups"] > 0  # --verify-every 1
    limits = {r["method"] for r in doc["results"] if r["method"].startswith("limit:")}
    assert {"limit:memcpy", "limit:read"} <= limits
    assert any("remote" in n for n in doc["notes"])  # skipped with a note, not an error
    assert png.stat().st_size > 10_000
    assert "GB/s" in proc.stdout


def test_latency_mode(tmp_path: Path) -> None:
    """One 64-byte request in flight: a round trip per method, the ring the default client's."""
    out = tmp_path / "lat.json"
    proc, tag, _ = _run(["--modes", "latency", "--methods", "transfer,transfer-socket,shm-pipe,zmq-copy",
                         "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_nothing_left(tag)
    lat = json.loads(out.read_text())["latency"]
    assert set(lat["rows"]) == {"transfer", "transfer-socket", "transfer-trio", "transfer-asyncio", "shm-pipe", "zmq-copy"}
    for r in lat["rows"].values():
        assert r["rounds"] > 0 and r["p99_us"] >= r["p50_us"] > 0
    assert "latency" in proc.stdout and "x shm-pipe" in proc.stdout


def test_share_mode_tiny(tmp_path: Path) -> None:
    """Tenants through one daemon against a process each (NumPy here): every tenant measured,
    a fairness index, and the latency tenant alone and beside a bulk one; nothing left."""
    out = tmp_path / "share.json"
    proc, tag, _ = _run(["--modes", "share", "--producers", "2", "--reps", "1", "--rep-seconds", "0.2", "--json", str(out)],
                        tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_nothing_left(tag)
    share = json.loads(out.read_text())["share"]
    assert [r["method"] for r in share["rows"]] == ["transfer", "processes"]
    for r in share["rows"]:
        assert r["tenants"] == 2 and len(r["tenant_per_s"]) == 2 and min(r["tenant_per_s"]) > 0
        assert 0.5 <= r["fairness"] <= 1.0
    lat = share["latency"]
    assert lat["alone"]["p99_us"] >= lat["alone"]["p50_us"] > 0 and lat["beside_bulk"]["rounds"] > 0 and lat["bulk_gbps"] > 0
    assert "share mode" in proc.stdout


def test_registration_mode_tiny(tmp_path: Path) -> None:
    """A producer's memory made a remote segment and let go, against NIXL's own registration,
    and registered again while live (reused): every figure measured, nothing left behind."""
    from transfer.transport import _nixl

    if not _nixl.available():
        pytest.skip("the registration mode needs NIXL (pip install --no-deps nixl-cu12==1.5.1)")
    out = tmp_path / "reg.json"
    proc, tag, _ = _run(["--modes", "registration", "--sizes", "1M,64M", "--reps", "2", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_nothing_left(tag)
    rows = json.loads(out.read_text())["registration"]["rows"]
    assert [r["size"] for r in rows] == [1 << 20, 64 << 20]
    for r in rows:
        assert min(r["raw_register_us"], r["register_us"], r["free_us"], r["again_us"], r["again_free_us"]) > 0
        assert r["register_vs_raw"] > 0
    assert "registration mode" in proc.stdout


def test_every_bench_tool_says_how_to_use_it() -> None:
    """Each maintained tool in bench/ answers --help (the tests below run each one small)."""
    tools = sorted(p for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_"))
    assert {p.name for p in tools} >= {"graphs.py", "scaling.py", "remote.py", "hostile_soak.py", "soak.py", "results_doc.py"}
    for tool in tools:
        r = subprocess.run([sys.executable, str(tool), "--help"], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), (tool.name, r.stdout[-500:], r.stderr[-2000:])


def test_gpu_check_rehearses_on_a_cpu(tmp_path: Path) -> None:
    """bench/gpu_check.py's CPU twin (the fake driver) runs small, and its verdict lists every
    target, each missed where nothing was measured on a GPU."""
    out = tmp_path / "gpu.json"
    for part in (["fake", "--rounds", "200", "--copies", "300"], ["targets"]):
        r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *part, "--out", str(out)],
                           capture_output=True, text=True, timeout=180, cwd=ROOT)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["targets"] and not any(v["met"] for v in doc["targets"].values())
    assert "share mode fairness index" in doc["targets"]


def test_gpu_check_rehearses_remote_producers_into_device_memory_on_a_cpu(tmp_path: Path) -> None:
    """The GPU check's remote part on the stream simulation: the daemon READs a producer's
    batch straight into a (host-backed) device buffer, checksummed, beside raw NIXL."""
    from transfer.transport import _nixl

    if not _nixl.available():
        pytest.skip("the remote part needs NIXL (pip install --no-deps nixl-cu12==1.5.1)")
    out = tmp_path / "gpu.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "remote", "--backend", "streamsim",
                        "--sizes", "65536,1048576", "--reps", "2", "--out", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rem = json.loads(out.read_text())["remote"]
    assert rem["device_kind"] == "gpu" and rem["checksummed"] and [row["size"] for row in rem["rows"]] == [65536, 1048576]


def test_replot_redraws_a_recorded_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    png, md = tmp_path / "q.png", tmp_path / "q.md"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "replot.py"), str(ROOT / "bench/results/cpu-2vcpu/quick.json"),
                        "--png", str(png), "--md", str(md)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert png.stat().st_size > 0 and md.read_text().startswith("| method |")


def test_remote_bench_tiny(tmp_path: Path) -> None:
    from transfer.transport import _nixl

    if not _nixl.available():
        pytest.skip("bench/remote.py needs NIXL (pip install --no-deps nixl-cu12==1.5.1)")
    out = tmp_path / "remote.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "remote.py"), "--reps", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert json.loads(out.read_text())["results"]


def test_jain_fairness_index() -> None:
    from transfer._bench.share import jain

    assert jain([5.0, 5.0, 5.0, 5.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)  # one tenant gets everything: 1/n
    assert jain([3.0, 1.0]) == pytest.approx(16 / 20)
    assert jain([0.0, 0.0]) == 0.0


def test_iceoryx2_method_tiny(tmp_path: Path) -> None:
    """A real iceoryx2 run (throughput and latency), verified, that leaves nothing behind:
    no process, no /dev/shm file, no file under TMPDIR (iceoryx2's root is the run's dir)."""
    if not _iceoryx2_ok():
        pytest.skip("iceoryx2 not installed (pip install 'transfer[bench]')")
    tmpdir = tempfile.mkdtemp(prefix="tbi-", dir="/tmp")  # short: iceoryx2 binds unix sockets there
    out = tmp_path / "r.json"
    before = {n for n in os.listdir("/dev/shm") if n.startswith("tbi2-")}  # channels.iox_prefix
    try:
        args = ["--sizes", "4K,64K", "--producers", "2", "--modes", "local,latency", "--methods", "shm-pipe,iceoryx2",
                "--verify-every", "1", "--json", str(out), *TINY]
        proc, tag, _ = _run(args, tmp_path, env_extra={"TMPDIR": tmpdir})
        assert proc.returncode == 0, proc.stderr[-4000:]
        _assert_nothing_left(tag)
        assert os.listdir(tmpdir) == []
        assert {n for n in os.listdir("/dev/shm") if n.startswith("tbi2-")} <= before
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    doc = json.loads(out.read_text())
    res = [r for r in doc["results"] if r["method"] == "iceoryx2"]
    assert {(r["mode"], r["size"]) for r in res} == {("local", 4096), ("local", 65536)}
    for r in res:
        assert r["gbps"] > 0 and r["verified_groups"] == r["groups"] > 0
        assert r["vs_shm-pipe"] is not None
    lat = doc["latency"]["rows"]["iceoryx2"]
    assert lat["rounds"] > 0 and lat["p99_us"] >= lat["p50_us"] > 0
    assert not [n for n in doc["notes"] if "iceoryx2" in n]


def test_iceoryx2_corruption_fails_loudly(tmp_path: Path) -> None:
    """A group damaged in the loaned sample after its checksum fails the run."""
    if not _iceoryx2_ok():
        pytest.skip("iceoryx2 not installed (pip install 'transfer[bench]')")
    proc, tag, _ = _run(["--sizes", "64K", "--producers", "1", "--modes", "local", "--methods", "iceoryx2",
                         "--inject-corruption", "3", *TINY], tmp_path)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "mismatch" in proc.stderr
    _assert_nothing_left(tag)


def test_iceoryx2_missing_is_skipped_with_a_note(tmp_path: Path) -> None:
    """Without an importable iceoryx2 the run goes on with the other methods and says why."""
    fake = tmp_path / "fake"
    (fake / "iceoryx2").mkdir(parents=True)
    (fake / "iceoryx2" / "__init__.py").write_text("raise ImportError('no iceoryx2 in this test')\n")
    out = tmp_path / "r.json"
    args = ["--sizes", "64K", "--producers", "1", "--modes", "local,latency", "--methods", "shm-pipe,iceoryx2",
            "--json", str(out), *TINY]
    proc, tag, _ = _run(args, tmp_path, env_extra={"PYTHONPATH": f"{fake}{os.pathsep}{ROOT}"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_nothing_left(tag)
    doc = json.loads(out.read_text())
    assert {r["method"] for r in doc["results"] if not r["method"].startswith("limit:")} == {"shm-pipe"}
    assert set(doc["latency"]["rows"]) == {"shm-pipe"}
    notes = [n for n in doc["notes"] if n.startswith("method iceoryx2")]
    assert notes and "skipped" in notes[0] and "transfer[bench]" in notes[0]
    assert "method iceoryx2" in proc.stdout


def test_remote_mode_tiny(tmp_path: Path) -> None:
    """transfer (the daemon READs the producer's own memory over NIXL) vs raw NIXL READs."""
    if not _transfer_ok():
        pytest.skip("transfer core not available")
    if not _nixl_ok():
        pytest.skip("NIXL not importable")
    out = tmp_path / "r.json"
    md = tmp_path / "r.md"
    args = ["--sizes", "64K,1M", "--producers", "1", "--modes", "remote", "--methods", "transfer,nixl-raw",
            "--json", str(out), "--markdown", str(md), *TINY]
    proc, tag, _ = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _assert_nothing_left(tag)
    doc = json.loads(out.read_text())
    res = [r for r in doc["results"] if not r["method"].startswith("limit:")]
    assert {(r["method"], r["size"]) for r in res} == {(m, s) for m in ("transfer", "nixl-raw")
                                                       for s in (65536, 1 << 20)}
    for r in res:
        assert r["mode"] == "remote"
        assert r["gbps"] > 0 and r["verified_groups"] == r["groups"] > 0  # quick: every group verified
        assert r["vs_nixl-raw"] is not None and r["vs_nixl-raw"] > 0
        if r["method"] == "nixl-raw":
            assert r["vs_nixl-raw"] == 1.0
    assert "x nixl-raw" in proc.stdout and "× nixl-raw" in md.read_text()


@pytest.mark.parametrize("method,mode", [("transfer", "local"), ("zmq-copy", "local"), ("shm-pipe", "local"),
                                         ("transfer", "remote"), ("nixl-raw", "remote")])
def test_checksum_mismatch_fails_loudly(tmp_path: Path, method: str, mode: str) -> None:
    if method == "transfer" and not _transfer_ok():
        pytest.skip("transfer core not available")
    if mode == "remote" and not _nixl_ok():
        pytest.skip("NIXL not importable")
    args = ["--sizes", "64K", "--producers", "1", "--modes", mode, "--methods", method,
            "--inject-corruption", "3", *TINY]
    proc, tag, _ = _run(args, tmp_path)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "mismatch" in proc.stderr
    _assert_nothing_left(tag)


def test_bad_arguments_exit_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "transfer.cli.bench", "--methods", "carrier-pigeon"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown method" in proc.stderr


def test_size_parsing() -> None:
    from transfer._bench.common import parse_size, parse_sizes

    assert parse_size("4K") == 4096 and parse_size("64KiB") == 65536 and parse_size("1M") == 1 << 20
    assert parse_sizes("4K..256M") == [4096 << (2 * i) for i in range(9)]
    assert parse_sizes("4K,1M") == [4096, 1 << 20]
    with pytest.raises(ValueError):
        parse_size("3")


def test_plot_without_matplotlib_fails_before_measuring(tmp_path: Path) -> None:
    """matplotlib made unimportable (a shadow package first on the path): exit 2 at once, not 1 after the run."""
    shadow = tmp_path / "shadow" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named matplotlib (test shadow)')\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "transfer.cli.bench", "--methods", "shm-pipe", "--plot", str(tmp_path / "r.png")],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=f"{shadow.parent}:{ROOT}"),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--plot needs matplotlib" in proc.stderr and "transfer[plot]" in proc.stderr
    assert time.monotonic() - t0 < 20 and "limits" not in proc.stderr  # nothing measured


def test_gpu_mode_without_a_gpu_exits_2_having_measured_nothing(tmp_path: Path) -> None:
    from transfer._bench.gpu import available

    if available()[0]:
        pytest.skip("a GPU is usable here")
    proc = subprocess.run([sys.executable, "-m", "transfer.cli.bench", "--modes", "gpu"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "nothing to measure: " in proc.stderr and "skipped mode gpu: " in proc.stderr


def test_ring_daemon_bench_leaves_no_directory(tmp_path: Path) -> None:
    """bench/ring_daemon.py: its daemon's socket dir (in $TMPDIR) and its shm dir go with it."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    before = {n for n in os.listdir("/dev/shm") if n.startswith("ring-bench-shm-")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ring_daemon.py"), "--n", "20", "--batches", "2", "--idle", "0.2"],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmpdir)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "idle: the daemon used" in proc.stdout  # (its CPU while idle is measured, not asserted)
    assert os.listdir(tmpdir) == []
    assert {n for n in os.listdir("/dev/shm") if n.startswith("ring-bench-shm-")} == before


def _scaling():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_scaling", ROOT / "bench" / "scaling.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scaling_model_fits_and_predicts() -> None:
    """bench/scaling.py's model: the fit recovers known per-request, per-frame and per-byte
    costs, and a prediction is the least of its limits."""
    sc = _scaling()
    truth = {"per_request_us": 12.0, "per_frame_us": 300.0, "per_byte_ns": 0.25}
    rows = [{"size": s, "k": k, "cpu_us": sc.per_group(truth, s, k) * 1e6} for _, s, k in sc.WORKLOADS]
    got = sc.fit(rows, "cpu_us")
    for key, want in truth.items():
        assert got[key] == pytest.approx(want, rel=1e-6)
    model = {"cores": 2, "threads": 2, "daemon": truth, "producer": {"per_request_us": 5.0, "per_frame_us": 100.0, "per_byte_ns": 0.0}}
    one = {"size": 4096, "k": 1, "groups_per_s": 1000.0}
    p = sc.predict(model, one, 4, 2.0)
    assert p["limits"]["producers"] == 4000.0 and p["bound"] == "daemon_loop"
    assert p["groups_per_s"] == pytest.approx(1 / ((12.0 + 300.0) * 1e-6 + 0.25e-9 * 4096))
    assert sc.predict(model, one, 4, 0.5)["bound"] == "host_cores"
    big = {"size": 8 << 20, "k": 1, "groups_per_s": 100.0}
    assert "daemon_workers" in sc.predict(model, big, 4, 2.0)["limits"]  # posts over 1 MiB leave the loop
    rows = {(r["size"], r["k"]): r for r in sc.project(model, 200.0, 54.7, 8)}
    assert rows[(64 << 10, 1)]["bound"] == "control_plane" and rows[(64 << 20, 1)]["bound"] == "nic"
    assert rows[(64 << 10, 1)]["crossover_bytes"] == pytest.approx(25e9 * 312e-6)


@pytest.mark.slow
def test_scaling_bench_runs_tiny(tmp_path: Path) -> None:
    """The loopback check itself, tiny: remote producers against a real transferd, verified."""
    if not _nixl_ok():
        pytest.skip("NIXL not importable")
    out = tmp_path / "scaling.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "scaling.py"), "--producers", "1,2", "--seconds", "0.2", "--reps", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    assert len(doc["runs"]) == 8 and all(run["verified"] and run["groups"] > 0 for run in doc["runs"])
    assert len(doc["checks"]) == 4 and doc["model"]["daemon"]["per_frame_us"] > 0


def test_graphs_bench_tiny(tmp_path: Path) -> None:
    """bench/graphs.py runs end to end in a tiny configuration and records what docs/benchmarks.md reads
    (with --baseline pointing at this same checkout: the second daemon's path runs)."""
    out = tmp_path / "graphs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "graphs.py"), "--backend", "numpy", "--batches", "1,4",
                           "--image-batches", "2", "--image-size", "16", "--seconds", "0.05", "--reps", "1",
                           "--latency", "5", "--baseline", str(ROOT), "--json", str(out)],
                          cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python bench/graphs.py ") and doc["machine"]["blas_threads"] == "1"
    assert [r["batch"] for r in doc["mlp"]] == [1, 4] and [r["images"] for r in doc["images"]] == [2]
    assert [r["request"] for r in doc["latency"]] == ["compute", "copy"]
    assert all(r[f"{k}_p50_us"] > 0 for r in doc["latency"] for k in ("daemon", "baseline"))
    for r in doc["mlp"]:
        assert r["max_abs_error"] <= 1e-5
        assert r["daemon_per_s"] > 0 and r["in_process_per_s"] > 0 and r["kernels_per_s"] > 0
        assert r["daemon_vs_in_process"] > 0 and r["daemon_vs_kernels"] > 0
        assert r["baseline_per_s"] > 0 and r["daemon_vs_baseline"] > 0  # here the same code: the path works
    img = doc["images"][0]
    assert img["daemon_per_s"] > 0 and img["kernels_per_s"] > 0 and img["max_abs_error"] <= 1e-5


def test_graphs_bench_refuses_bad_sizes_before_it_starts(tmp_path: Path) -> None:
    """A zero or non-numeric batch size is a usage error (exit 2, naming the flag), before any
    daemon starts, not a daemon error from deep inside a run."""
    for flag, value, words in (("--image-batches", "0", "at least 1"), ("--batches", "4,x", "comma-separated")):
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "graphs.py"), flag, value], cwd=tmp_path,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and flag in proc.stderr and words in proc.stderr, proc.stderr[-2000:]
        assert "transferd" not in proc.stderr  # refused before a daemon started


@pytest.mark.parametrize("width", [80, 120, 200])
def test_the_results_table_keeps_every_digit_at_any_width(width: int) -> None:
    """The table fits the terminal by splitting into column groups (each with the columns that
    name the cell), never by eliding: at 80, 120 and 200 columns every figure is printed whole
    and no line is wider than the terminal."""
    from rich.console import Console

    from transfer._bench import report

    results = []
    for size in (4096, 65536, 1 << 20, 64 << 20, 256 << 20):
        for k, method in enumerate(("transfer", "transfer-socket", "shm-pipe", "iceoryx2", "torch-mp", "zmq-copy", "zmq-zerocopy")):
            results.append({
                "method": method, "mode": "local" if k % 2 else "compute", "size": size, "producers": 4, "depth": 16, "batch": 64,
                "gbps": 123.456 + k, "min_gbps": 100.25 + k, "max_gbps": 140.75 + k, "rps": 1_234_567.0 + k,
                "p50_us": 12_345.6 + k, "p99_us": 123_456.7 + k, "vs_shm-pipe": 10.25 + k, "vs_zmq-copy": 20.5 + k,
                "vs_zmq-zerocopy": 30.75 + k, "vs_limit": 0.5 + k / 100,
            })
    limits = {64 << 20: {"memcpy": {"gbps": 7.5, "min_gbps": 7.25, "max_gbps": 7.75, "rps": 112.0}}}
    con = Console(width=width, record=True, highlight=False)
    for table in report.render_tables(results, limits, "transfer-bench full: a long title", width):
        con.print(table)
    text = con.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    for k in range(7):
        for figure in (f"{123.456 + k:.2f}", f"{100.25 + k:.1f}-{140.75 + k:.1f}", report._rps(1_234_567.0 + k), f"{12_346 + k:,}",
                       f"{123_457 + k:,}", f"{10.25 + k:.2f}", f"{20.5 + k:.2f}", f"{30.75 + k:.2f}", f"{0.5 + k / 100:.2f}"):
            assert figure in text, (figure, width)
