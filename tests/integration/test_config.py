"""transferd's settings: flags > env > file > defaults, through the real CLI.

Every precedence and error case runs `python -m transfer.cli.transferd` in a
subprocess with a scrubbed environment; `--print-config json` reports each
value and its source, so nothing here needs a running daemon except the last
tests (a daemon configured only by file and env, and --log-json output).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

import transfer
from transfer import _settings as S
from transfer.protocol import Limits
from transfer.server import DaemonConfig


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFER_")}
    env.update(extra)
    return env


def transferd(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "transfer.cli.transferd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else clean_env(),
    )


def effective(*args: str, env: dict[str, str] | None = None) -> dict[str, dict[str, object]]:
    r = transferd(*args, "--print-config", "json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["settings"]


def write(tmp_path: Path, text: str, name: str = "transferd.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# --- precedence -------------------------------------------------------------------------------
def test_defaults_come_from_daemonconfig() -> None:
    got = effective()
    d, lim = DaemonConfig(), Limits()
    assert got["session_timeout_s"] == {"value": d.session_timeout_s, "source": "default"}
    assert got["max_device_bytes"]["value"] == d.max_device_bytes
    assert got["limits.max_frame_bytes"]["value"] == lim.max_frame_bytes
    assert got["backend"] == {"value": "auto", "source": "default"}  # the CLI probes for a GPU
    assert got["metrics_port"]["value"] == 0


def test_flags_beat_env_beat_file_beat_defaults(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        """
threads = 3
heartbeat_s = 0.5
session_timeout_s = 7
max_device_bytes = "1GiB"
devices = 2
[limits]
max_frame_bytes = "8MiB"
""",
    )
    env = clean_env(TRANSFER_THREADS="4", TRANSFER_SESSION_TIMEOUT="9.5", TRANSFER_BACKEND="numpy")
    got = effective("--config", str(cfg), "--threads", "5", "--devices", "3", env=env)
    assert got["threads"] == {"value": 5, "source": "flag --threads"}  # flag > env > file
    assert got["session_timeout_s"] == {"value": 9.5, "source": "env TRANSFER_SESSION_TIMEOUT"}  # env > file
    assert got["devices"] == {"value": 3, "source": "flag --devices"}  # flag > file
    assert got["heartbeat_s"] == {"value": 0.5, "source": f"file {cfg}"}
    assert got["max_device_bytes"] == {"value": 1 << 30, "source": f"file {cfg}"}
    assert got["limits.max_frame_bytes"] == {"value": 8 << 20, "source": f"file {cfg}"}
    assert got["backend"] == {"value": "numpy", "source": "env TRANSFER_BACKEND"}
    assert got["max_pass" if "max_pass" in got else "inline_bytes"]["source"] == "default"


def test_config_file_from_env_and_flag_beats_it(tmp_path: Path) -> None:
    a = write(tmp_path, "threads = 6\n", "a.toml")
    b = write(tmp_path, "threads = 7\n", "b.toml")
    assert effective(env=clean_env(TRANSFER_CONFIG=str(a)))["threads"] == {"value": 6, "source": f"file {a}"}
    assert effective("--config", str(b), env=clean_env(TRANSFER_CONFIG=str(a)))["threads"]["value"] == 7


def test_booleans_endpoints_and_sizes_from_every_source(tmp_path: Path) -> None:
    cfg = write(tmp_path, 'allow_remote_tcp = true\nendpoints = ["ipc:///tmp/x/a.sock", "tcp://127.0.0.1:5555"]\nlog_json = true\n')
    got = effective("--config", str(cfg))
    assert got["allow_remote_tcp"]["value"] is True
    assert got["endpoints"]["value"] == ["ipc:///tmp/x/a.sock", "tcp://127.0.0.1:5555"]
    got = effective("--config", str(cfg), "--no-allow-remote-tcp", env=clean_env(TRANSFER_LOG_JSON="off", TRANSFER_ENDPOINT="ipc:///tmp/y.sock,tcp://127.0.0.1:1"))
    assert got["allow_remote_tcp"] == {"value": False, "source": "flag --allow-remote-tcp"}
    assert got["log_json"] == {"value": False, "source": "env TRANSFER_LOG_JSON"}
    assert got["endpoints"]["value"] == ["ipc:///tmp/y.sock", "tcp://127.0.0.1:1"]
    got = effective("--endpoint", "ipc:///tmp/p.sock", "--endpoint", "ipc:///tmp/q.sock", "--max-host-bytes-per-session", "64MiB", "--inline-bytes", "4KiB", "--max-segments-per-session", "0x10")
    assert got["endpoints"] == {"value": ["ipc:///tmp/p.sock", "ipc:///tmp/q.sock"], "source": "flag --endpoint"}
    assert got["max_host_bytes_per_session"]["value"] == 64 << 20
    assert got["inline_bytes"]["value"] == 4096
    assert got["max_segments_per_session"]["value"] == 16


def test_print_config_toml_round_trips(tmp_path: Path) -> None:
    env = clean_env(TRANSFER_MAX_SEGMENTS_PER_SESSION="17", TRANSFER_SHM_DIR=str(tmp_path))
    r = transferd("--print-config", "--metrics-port", "9999", env=env)
    assert r.returncode == 0, r.stderr
    assert "max_segments_per_session = 17  # env TRANSFER_MAX_SEGMENTS_PER_SESSION" in r.stdout
    assert "metrics_port = 9999  # flag --metrics-port" in r.stdout
    assert "[limits]" in r.stdout
    # What --print-config prints is itself a valid config file with the same values.
    cfg = write(tmp_path, r.stdout)
    again = effective("--config", str(cfg))
    assert again["max_segments_per_session"]["value"] == 17
    assert again["shm_dir"]["value"] == str(tmp_path)
    assert again["metrics_port"]["value"] == 9999


def test_every_daemonconfig_and_limits_field_is_a_setting() -> None:
    keys = {s.key for s in S.SETTINGS}
    for f in dataclasses.fields(DaemonConfig):
        if f.name != "limits":
            assert f.name in keys, f"DaemonConfig.{f.name} has no setting"
    for f in dataclasses.fields(Limits):
        assert f"limits.{f.name}" in keys
    # Each setting has a distinct flag and env var, derived the same way.
    assert len({s.flag for s in S.SETTINGS}) == len(S.SETTINGS)
    assert all(s.env == "TRANSFER_" + s.flag[2:].upper().replace("-", "_") for s in S.SETTINGS)
    # And resolve() builds a DaemonConfig from the defaults without loss.
    cfg = S.resolve({}, {}).daemon_config()
    assert cfg.limits == Limits() and cfg.threads == DaemonConfig().threads


# --- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args, env, needle",
    [
        ((), {"TRANSFER_SESSION_TIMEOUT": "abc"}, "session_timeout_s = 'abc' from env TRANSFER_SESSION_TIMEOUT: not a number"),
        (("--threads", "two"), {}, "threads = 'two' from flag --threads: not an integer"),
        (("--threads", "0"), {}, "threads = '0' from flag --threads: must be at least 1"),
        (("--backend", "tpu"), {}, "backend = 'tpu' from flag --backend: not one of auto, cupy, numpy"),
        ((), {"TRANSFER_ALLOW_REMOTE_TCP": "maybe"}, "allow_remote_tcp = 'maybe' from env TRANSFER_ALLOW_REMOTE_TCP: not a boolean"),
        ((), {"TRANSFER_MAX_DEVICE_BYTES": "lots"}, "max_device_bytes = 'lots' from env TRANSFER_MAX_DEVICE_BYTES: not a size"),
        (("--metrics-port", "70000"), {}, "metrics_port = '70000' from flag --metrics-port: must be at most 65535"),
        (("--endpoint", "http://x"), {}, "endpoints = 'http://x' from flag --endpoint: 'http://x' is not ipc://PATH or tcp://HOST:PORT"),
        (("--heartbeat", "nan"), {}, "heartbeat_s = 'nan' from flag --heartbeat: not a finite number"),
        (("--heartbeat", "5"), {"TRANSFER_SESSION_TIMEOUT": "2"}, "session_timeout_s = 2 from env TRANSFER_SESSION_TIMEOUT: must exceed heartbeat_s = 5 from flag --heartbeat"),
    ],
)
def test_bad_values_name_key_value_and_source(args: tuple[str, ...], env: dict[str, str], needle: str) -> None:
    r = transferd(*args, "--print-config", env=clean_env(**env))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize(
    "text, needle",
    [
        ("threads = 2\nthread_count = 3\n", "unknown key 'thread_count' in"),
        ("max_frame_bytes = 100\n", "unknown key 'max_frame_bytes' in {path} (did you mean [limits] max_frame_bytes?)"),
        ("[limits]\nmax_frames = 1\n", "unknown key 'limits.max_frames' in"),
        ("limits = 3\n", "limits in {path}: must be a table"),
        ("threads = 2.5\n", "threads = 2.5 from file {path}: not an integer"),
        ("session_timeout_s = 'abc'\n", "session_timeout_s = 'abc' from file {path}: not a number"),
        ("endpoints = [1, 2]\n", "endpoints = [1, 2] from file {path}: not a list of endpoints"),
        ("threads = \n", "is not valid TOML"),
    ],
)
def test_bad_files_are_errors(tmp_path: Path, text: str, needle: str) -> None:
    cfg = write(tmp_path, text)
    r = transferd("--config", str(cfg), "--print-config")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle.format(path=cfg) in r.stderr


def test_missing_config_file(tmp_path: Path) -> None:
    r = transferd("--config", str(tmp_path / "nope.toml"), "--print-config")
    assert r.returncode == 2 and "cannot read config file" in r.stderr and "nope.toml" in r.stderr


def test_bad_config_refuses_to_serve(tmp_path: Path) -> None:
    """A config error stops the daemon before it binds anything."""
    sock = tmp_path / "d.sock"
    r = transferd("--endpoint", f"ipc://{sock}", "--shm-dir", str(tmp_path), env=clean_env(TRANSFER_THREADS="-1"))
    assert r.returncode == 2 and "threads = '-1' from env TRANSFER_THREADS" in r.stderr
    assert not sock.exists()


# --- a daemon configured by file and env, logging JSON -------------------------------------
def test_daemon_runs_from_file_and_env_with_json_logs(tmp_path: Path, shm_dir: Path) -> None:
    wd = tmp_path / "run"
    wd.mkdir(mode=0o700)
    endpoint = f"ipc://{wd}/d.sock"
    cfg = write(
        tmp_path,
        f'endpoints = ["{endpoint}"]\nbackend = "numpy"\nheartbeat_s = 0.2\nsession_timeout_s = 2\n'
        f'shm_dir = "{shm_dir}"\nmax_segments_per_session = 2\nlog_level = "info"\n',
    )
    env = clean_env(TRANSFER_LOG_JSON="1", TRANSFER_MAX_HOST_BYTES_PER_SESSION="1MiB")
    proc = subprocess.Popen(
        [sys.executable, "-m", "transfer.cli.transferd", "--config", str(cfg), "--ready"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["endpoints"] == [endpoint]
        with transfer.connect(endpoint) as c:
            c.segment(512 << 10)
            with pytest.raises(transfer.QuotaExceeded):
                c.segment(768 << 10)  # the env's host-bytes quota
            c.segment(256 << 10)
            with pytest.raises(transfer.QuotaExceeded):
                c.segment(4096)  # the file's segment quota (2)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert lines, "no log lines"
    for rec in lines:
        assert set(rec) >= {"ts", "level", "logger", "msg"} and rec["ts"].endswith("Z")
    assert any(rec["logger"].startswith("transfer") and rec["level"] == "INFO" for rec in lines)


# --- the JSON formatter alone -------------------------------------------------------------
def test_json_formatter_fields_session_and_exceptions() -> None:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(S.JsonFormatter())
    log = logging.getLogger("transfer.test.json")
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        log.info("session %d opened by %r", 7, "producer\n\"x\"", extra={"session": 7})
        log.warning("plain")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed", extra={"session": "abc"})
    finally:
        log.removeHandler(handler)
    a, b, c = (json.loads(line) for line in buf.getvalue().splitlines())
    assert a["msg"] == "session 7 opened by 'producer\\n\"x\"'" and a["session"] == 7
    assert a["level"] == "INFO" and a["logger"] == "transfer.test.json"
    assert "session" not in b and b["level"] == "WARNING"
    assert c["session"] == "abc" and "ValueError: boom" in c["exc"]


def test_setup_logging_switches_formatter() -> None:
    buf = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        S.setup_logging("info", json_lines=True, stream=buf)
        logging.getLogger("transfer.x").info("hello")
        assert json.loads(buf.getvalue())["msg"] == "hello"
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in saved[0]:
            root.addHandler(h)
        root.setLevel(saved[1])


def test_size_parsing() -> None:
    assert S.parse_size(5) == 5
    assert S.parse_size("4096") == 4096
    assert S.parse_size("64MiB") == 64 << 20
    assert S.parse_size("16G") == 16 << 30
    assert S.parse_size("1.5k") == 1536
    for bad in ("1.3", "x", "-5", True, 1.5, "1e9"):
        with pytest.raises(ValueError):
            S.parse_size(bad)
