"""transferd as a user runs it: flags, refusals, clean exits."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import transfer
from transfer import backends
from transfer.testing import loopback_endpoint, start_daemon


def transferd(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "transfer.cli.transferd", *args], capture_output=True, text=True, timeout=timeout)


def test_refuses_unauthenticated_tcp_off_loopback(tmp_path: Path) -> None:
    r = transferd("--endpoint", "tcp://0.0.0.0:5999", "--shm-dir", str(tmp_path))
    assert r.returncode == 1 and "only allowed on loopback" in r.stderr


def test_a_channel_port_in_use_is_a_clear_startup_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = transferd("--endpoint", loopback_endpoint(), "--allow-insecure-tcp", "--channel-port", str(port), "--shm-dir", str(tmp_path))
    assert r.returncode == 1 and "cannot listen for data channels" in r.stderr and "--channel-port" in r.stderr, r.stderr[-2000:]


def test_refuses_a_second_daemon_on_a_live_endpoint(daemon) -> None:
    r = transferd("--endpoint", daemon.endpoint, "--shm-dir", str(daemon.shm_dir))
    assert r.returncode == 1 and "already listening" in r.stderr
    with transfer.connect(daemon.endpoint) as c:  # the first one is untouched
        c.fence()


def test_loopback_tcp_endpoint_serves(shm_dir: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wd = tmp_path / "w"
    wd.mkdir()
    d = start_daemon(["--endpoint", f"tcp://127.0.0.1:{port}", "--allow-insecure-tcp", "--backend", "numpy"], workdir=wd, shm_dir=shm_dir)
    try:
        with transfer.connect(f"tcp://127.0.0.1:{port}") as c:
            buf = c.alloc(4096)
            c.fill(buf, 4096, 1).result()
            assert c.checksum(buf).result() == transfer.checksum64(b"\x01" * 4096)
    finally:
        assert d.stop() == 0


def test_help_lists_the_flags() -> None:
    r = transferd("--help")
    assert r.returncode == 0 and "--backend" in r.stdout and "--shm-dir" in r.stdout


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here: auto may pick it")
def test_auto_backend_says_why_it_chose_numpy(daemon_factory: Any, capfd: pytest.CaptureFixture[str]) -> None:
    d = daemon_factory("--backend", "auto", "--log-level", "INFO")
    assert d.ready["backend"] == "numpy"
    assert d.ready["backend_reason"] == "auto: CuPy is not installed (pip install 'transfer[gpu]')"
    with transfer.connect(d.endpoint) as c:
        c.fence()
    assert d.stop() == 0
    err = capfd.readouterr().err  # the daemon's log (it inherits our stderr)
    assert "backend numpy: auto: CuPy is not installed" in err
    assert "backend numpy (auto: CuPy is not installed" in err  # the startup line says it too


def test_auto_warns_when_cupy_is_installed_but_unusable(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Importing the module imports no CuPy: that is probe()'s job.
    from transfer.backends._cupy import CupyBackend

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "cupy" else real(name, *a))
    monkeypatch.setattr(CupyBackend, "probe", staticmethod(lambda: (False, "CUDARuntimeError: cudaErrorInsufficientDriver")))
    with caplog.at_level(logging.INFO, logger="transfer.backends"):
        backend, why = backends.select_backend("auto")
        with pytest.raises(RuntimeError, match="no usable CUDA device .*InsufficientDriver"):
            backends.select_backend("cupy")
    assert backend.name == "numpy" and why == "auto: CuPy is installed but unusable (CUDARuntimeError: cudaErrorInsufficientDriver)"
    (rec,) = [r for r in caplog.records if r.name == "transfer.backends"]
    assert rec.levelno == logging.WARNING and why in rec.getMessage()


# --- the daemon as a service -------------------------------------------------------
def test_version_from_transferd_and_python_m_transfer() -> None:
    for cmd in ([sys.executable, "-m", "transfer.cli.transferd"], [sys.executable, "-m", "transfer"]):
        r = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=20)
        assert r.returncode == 0 and r.stdout.startswith(f"transferd {transfer.__version__} (protocol ")


def test_a_missing_shm_dir_is_refused_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "typo"
    r = transferd("--endpoint", f"ipc://{tmp_path}/s/d.sock", "--shm-dir", str(missing))
    assert r.returncode == 1 and f"shm dir {missing} does not exist: create it" in r.stderr
    assert not missing.exists()


def test_a_shm_dir_off_tmpfs_is_named_in_a_warning(daemon_factory: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    from transfer.server._preflight import check_shm_dir

    disk = tmp_path / "shm"
    disk.mkdir(mode=0o700)
    if check_shm_dir(disk).in_memory:
        pytest.skip("the temp dir is on tmpfs here")
    capfd.readouterr()
    d = daemon_factory("--shm-dir", str(disk))
    assert d.stop() == 0
    assert f"shm dir {disk} is on " in capfd.readouterr().err


def test_unknown_placement_is_a_config_error(tmp_path: Path) -> None:
    r = transferd("--endpoint", f"ipc://{tmp_path}/s/d.sock", "--placement", "bad")
    assert r.returncode == 2
    assert "config error: placement = 'bad' from flag --placement: not one of size, least-loaded, round-robin" in r.stderr


def test_a_taken_metrics_port_says_so(shm_dir: Path, tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = transferd("--endpoint", f"ipc://{tmp_path}/s/d.sock", "--shm-dir", str(shm_dir), "--backend", "numpy", "--metrics-port", str(port))
    assert r.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr and "--metrics-port" in r.stderr
    assert "Traceback" not in r.stderr


def test_startup_line_and_systemd_readiness(shm_dir: Path, tmp_path: Path) -> None:
    """A real transferd under a fake systemd: READY=1 on $NOTIFY_SOCKET once it serves, one
    startup line on stderr at the default log level, STOPPING=1 when SIGTERM starts the drain."""
    import os
    import signal
    import socket

    notify_path = tmp_path / "notify"
    sock_dir = tmp_path / "run"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as nsock:
        nsock.bind(str(notify_path))
        nsock.settimeout(20)
        proc = subprocess.Popen(
            [sys.executable, "-m", "transfer", "--endpoint", f"ipc://{sock_dir}/d.sock", "--shm-dir", str(shm_dir),
             "--backend", "numpy", "--max-host-bytes", "1P", "--max-sessions", "7"],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "NOTIFY_SOCKET": str(notify_path)},
        )
        try:
            ready = dict(kv.split("=", 1) for kv in nsock.recv(4096).decode().splitlines())
            assert ready["READY"] == "1" and ready["MAINPID"] == str(proc.pid) and "serving" in ready["STATUS"]
            with transfer.connect(f"ipc://{sock_dir}/d.sock") as c:
                c.fence()
            proc.send_signal(signal.SIGTERM)
            assert "STOPPING=1" in nsock.recv(4096).decode().splitlines()
            _, err = proc.communicate(timeout=20)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    (line,) = [ln for ln in err.splitlines() if "transfer.daemon.startup" in ln]
    for part in (f"transferd {transfer.__version__} (protocol", f"serving ipc://{sock_dir}/d.sock", f"shm dir {shm_dir} (tmpfs",
                 "backend numpy (", "limits: 7 sessions", "host memory 1024 TiB", "shared memory available"):
        assert part in line, (part, line)
    # A quota the machine cannot honour is named, with what to change.
    assert "--max-host-bytes is 1024 TiB but only" in err and "Lower --max-host-bytes" in err


def test_sd_notify_is_a_no_op_outside_systemd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import socket

    from transfer.cli._systemd import notify

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify(READY=1) is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert notify(READY=1) is False  # no listener: never raises
    name = f"transfer-test-{tmp_path.name}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)  # the abstract namespace, as systemd may use
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify(READY=1, STATUS="x") is True
        assert s.recv(100) == b"READY=1\nSTATUS=x"


def test_the_systemd_unit_matches_the_daemon() -> None:
    """deploy/transferd.service: notify readiness, a socket directory transferd accepts, no restart on exit 2."""
    import configparser

    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(Path(__file__).resolve().parents[2] / "deploy" / "transferd.service")
    svc = unit["Service"]
    assert svc["Type"] == "notify" and svc["ExecStart"].split()[0].endswith("transferd")
    assert int(svc["RuntimeDirectoryMode"], 8) & 0o077 == 0  # _prepare_ipc refuses anything wider
    assert svc["Environment"].startswith("TRANSFER_") and "2" in svc["RestartPreventExitStatus"].split()
    endpoint = [ln for ln in (Path(__file__).resolve().parents[2] / "deploy" / "transferd.service").read_text().splitlines()
                if ln.startswith("Environment=TRANSFER_ENDPOINT=")][0].split("=", 2)[2]
    assert endpoint.startswith(f"ipc:///run/{svc['RuntimeDirectory']}/")


def test_the_systemd_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    """deploy/transferd.service, installed as its header says (a venv whose transferd it runs):
    `systemd-analyze verify` finds nothing, and `systemd-analyze security` rates it OK or
    better (an exposure below 5). Here the venv is this test's own interpreter's."""
    import re
    import shutil
    import subprocess
    import sys

    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    transferd = Path(sys.executable).parent / "transferd"
    if not transferd.exists():
        pytest.skip(f"no transferd beside {sys.executable} (the package is not installed in this venv)")
    text = (Path(__file__).resolve().parents[2] / "deploy" / "transferd.service").read_text()
    assert "ExecStart=/opt/transfer/bin/transferd " in text  # the install the header describes
    unit = tmp_path / "transferd.service"
    unit.write_text(text.replace("/opt/transfer/bin/transferd", str(transferd)))
    verify = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [ln for ln in (verify.stdout + verify.stderr).splitlines() if "transferd.service" in ln]
    assert verify.returncode == 0 and not problems, verify.stdout + verify.stderr
    security = subprocess.run([tool, "security", "--offline=true", str(unit)], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for transferd\.service: (\d+\.\d+) (\w+)", security.stdout)
    assert m is not None, security.stdout[-2000:] + security.stderr
    assert float(m.group(1)) < 5.0 and m.group(2) in ("OK", "SAFE"), m.group(0)


def test_the_container_recipe_runs_under_an_init_drains_in_time_and_checks_health(daemon: Any) -> None:
    """deploy/Dockerfile: tini as PID 1, SIGTERM to stop, a drain grace inside `docker stop`'s
    10 s, and a HEALTHCHECK whose command, run here, passes against a live daemon and fails
    without one."""
    import json
    import subprocess
    import sys

    text = (Path(__file__).resolve().parents[2] / "deploy" / "Dockerfile").read_text()
    final = text.rsplit("\nFROM ", 1)[1]
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", final, re.M).group(1))  # type: ignore[union-attr]
    assert entry[:3] == ["tini", "--", "transferd"] and "tini" in final.split("ENTRYPOINT")[0]
    assert re.search(r"^STOPSIGNAL SIGTERM$", final, re.M)
    grace = float(re.search(r"TRANSFER_SHUTDOWN_GRACE=(\d+(?:\.\d+)?)", final).group(1))  # type: ignore[union-attr]
    assert grace < 10, "the drain must end inside docker stop's 10 s"
    check = json.loads(re.search(r"^\s+CMD (\[.*\])$", final, re.M).group(1))  # type: ignore[union-attr]
    assert check[0] == "python"
    run = [sys.executable, *check[1:]]
    ok = subprocess.run(run, env={**os.environ, "TRANSFER_ENDPOINT": daemon.endpoint}, capture_output=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    gone = subprocess.run(run, env={**os.environ, "TRANSFER_ENDPOINT": daemon.endpoint + ".none"}, capture_output=True, timeout=60)
    assert gone.returncode != 0


def test_the_kubernetes_manifests_are_valid_and_agree_with_the_daemon() -> None:
    """deploy/kubernetes: every object validates against the Kubernetes schemas (strict: an
    unknown or misspelt field fails), and the DaemonSet and the producer agree with each other
    and with the daemon: one socket directory on a hostPath, the endpoint in it, the fd socket
    there too (--shm-dir), one uid, nothing else shared, probes, a GPU, a grace the drain fits."""
    yaml = pytest.importorskip("yaml")
    kv = pytest.importorskip("kubernetes_validate")
    here = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
    docs = {d["kind"]: d for f in sorted(here.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())}
    for doc in docs.values():
        kv.validate(doc, "1.30", strict=True)
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    producer = docs["Pod"]["spec"]
    daemon = pod["containers"][0]
    env = {e["name"]: e["value"] for e in daemon["env"]}
    run = pod["volumes"][0]["hostPath"]["path"]
    assert env["TRANSFER_ENDPOINT"] == f"ipc://{run}/transferd.sock" and env["TRANSFER_SHM_DIR"] == run
    assert daemon["volumeMounts"][0]["mountPath"] == run and producer["volumes"][0]["hostPath"]["path"] == run
    assert {e["name"]: e["value"] for e in producer["containers"][0]["env"]}["TRANSFER_ENDPOINT"] == env["TRANSFER_ENDPOINT"]
    assert pod["securityContext"]["runAsUser"] == producer["securityContext"]["runAsUser"]
    assert not pod.get("hostPID") and not producer.get("hostPID")  # (only the socket directory is shared)
    assert "transfer.connect" in " ".join(daemon["readinessProbe"]["exec"]["command"])
    assert daemon["livenessProbe"]["httpGet"]["path"] == "/metrics" and "--metrics-port" in daemon["args"]
    assert daemon["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert pod["terminationGracePeriodSeconds"] > 7  # the image's TRANSFER_SHUTDOWN_GRACE
