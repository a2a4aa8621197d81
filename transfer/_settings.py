"""transferd's settings: one schema, four sources, and where each value came from.

Precedence, highest first: command-line flags > ``TRANSFER_*`` environment
variables > the TOML file (``--config`` or ``$TRANSFER_CONFIG``) > defaults.
Every setting has exactly one TOML key, one flag and one environment variable,
derived from the same table (`SETTINGS`), so docs, ``--help`` and
``--print-config`` cannot drift apart.

Values from every source go through the same parser, so an error always
names the key, the value and its origin::

    session_timeout_s = 'abc' from env TRANSFER_SESSION_TIMEOUT: not a number

Unknown keys in the file are errors (a typo must not silently fall back to a
default). Unknown ``TRANSFER_*`` variables are ignored: the client side and
other tools use the same prefix (``TRANSFER_ENDPOINT`` is shared on purpose).

This module also holds `JsonFormatter` (``--log-json``): one JSON object per
log line.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import math
import os
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ._units import fmt_bytes, parse_size

__all__ = [
    "Setting",
    "SETTINGS",
    "ConfigError",
    "Resolved",
    "resolve",
    "add_flags",
    "parse_size",
    "JsonFormatter",
    "setup_logging",
]

ENV_PREFIX = "TRANSFER_"


class ConfigError(ValueError):
    """A bad setting; the message names the key, the value and where it came from."""


# --- value parsers: (raw value from any source) -> typed value, or ValueError(reason) ---------
def _int(raw: Any) -> int:
    if type(raw) is int:
        return raw
    if isinstance(raw, str):
        try:
            return int(raw.strip(), 0)
        except ValueError:
            pass
    raise ValueError("not an integer")


def _float(raw: Any) -> float:
    if type(raw) in (int, float):
        v = float(raw)
    elif isinstance(raw, str):
        try:
            v = float(raw.strip())
        except ValueError:
            raise ValueError("not a number") from None
    else:
        raise ValueError("not a number")
    if not math.isfinite(v):
        raise ValueError("not a finite number")
    return v


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bool(raw: Any) -> bool:
    if type(raw) is bool:
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _TRUE | _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError("not a boolean (true/false, 1/0, yes/no, on/off)")


def _str(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    raise ValueError("not a string")


def _path(raw: Any) -> Path:
    if isinstance(raw, (str, Path)) and str(raw):
        return Path(raw).expanduser()
    raise ValueError("not a path")


def _endpoints(raw: Any) -> tuple[str, ...]:
    """A TOML list of strings, or one string with comma-separated endpoints (env, flag)."""
    if isinstance(raw, str):
        items = [s.strip() for s in raw.split(",") if s.strip()]
    elif isinstance(raw, (list, tuple)) and all(isinstance(s, str) for s in raw):
        items = list(raw)
    else:
        raise ValueError("not a list of endpoints")
    if not items:
        raise ValueError("needs at least one endpoint")
    from .transport._zmq import endpoint_error

    for ep in items:
        why = endpoint_error(ep)
        if why is not None:
            raise ValueError(why)
    return tuple(items)


# --- the schema -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One setting. `key` is the TOML key (``limits.x`` lives in the ``[limits]`` table)."""

    key: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    flag: str  # "--session-timeout"
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    #: "daemon": a DaemonConfig field; "limits": a protocol Limits field; "process": transferd itself.
    target: str = "daemon"
    metavar: str = ""
    boolean: bool = False

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.flag[2:].upper().replace("-", "_")

    @property
    def field(self) -> str:
        return self.key.split(".")[-1]

    @property
    def dest(self) -> str:
        return "cfg_" + self.key.replace(".", "_")

    def check(self, raw: Any) -> Any:
        """Parse and range-check; raises ValueError(reason)."""
        value = self.parse(raw)
        if self.choices and value not in self.choices:
            raise ValueError(f"not one of {', '.join(self.choices)}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"must be at least {_num(self.minimum)}")
        if self.maximum is not None and value > self.maximum:
            raise ValueError(f"must be at most {_num(self.maximum)}")
        return value


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_MISSING = object()


def _auto_parser(name: str, default: Any) -> Callable[[Any], Any] | None:
    if isinstance(default, bool):
        return _bool
    if isinstance(default, int):
        return parse_size if "bytes" in name else _int
    if isinstance(default, float):
        return _float
    if isinstance(default, str):
        return _str
    if isinstance(default, Path):
        return _path
    return None


def _defaults() -> tuple[Setting, ...]:
    # Defaults come from DaemonConfig / Limits themselves (one source of truth), except
    # the CLI's backend, which probes for a GPU ("auto") where the library default is numpy.
    # A DaemonConfig field without an entry below still gets a setting (`_auto_parser`), so a
    # new field is configurable the day it lands; an entry whose field is gone is skipped.
    import dataclasses

    from .protocol import Limits
    from .server._config import DaemonConfig
    from .server._placement import POLICIES

    d, lim = DaemonConfig(), Limits()
    table: list[tuple[Any, ...]] = [
        # key, parser, help, flag, extra keyword arguments
        ("endpoints", _endpoints, "ipc://PATH or tcp://127.0.0.1:PORT; repeat the flag (or comma-separate) for several", "--endpoint", {"metavar": "URL"}),
        ("backend", _str, "device backend: auto probes CuPy (an allocation, not just the import), else NumPy; streamsim: a simulated GPU for tests", "--backend", {"choices": ("auto", "cupy", "numpy", "streamsim"), "default": "auto"}),
        ("devices", _int, "virtual CPU devices for the numpy backend", "--devices", {"minimum": 1, "maximum": 1024}),
        ("shm_dir", _path, "directory for the daemon's lock and fd socket (segments and rings are sealed memfds, doorbells pipes); this user's, or root's with the sticky bit, and sticky if others may write it", "--shm-dir", {"metavar": "DIR"}),
        ("heartbeat_s", _float, "seconds between idle clients' pings (announced in hello)", "--heartbeat", {"minimum": 0.01, "metavar": "SECONDS"}),
        ("session_timeout_s", _float, "reclaim a session silent this long (must exceed the heartbeat)", "--session-timeout", {"minimum": 0.05, "metavar": "SECONDS"}),
        ("max_segments_per_session", _int, "segments (host + device) one session may hold; 0 = unlimited", "--max-segments-per-session", {"minimum": 0}),
        ("max_host_bytes_per_session", parse_size, "shared-memory bytes one session may hold; 0 = unlimited", "--max-host-bytes-per-session", {"minimum": 0, "metavar": "BYTES"}),
        ("max_host_bytes", parse_size, "the whole daemon's shared-memory budget (memfds: RAM and swap); 0 = what the machine has", "--max-host-bytes", {"minimum": 0, "metavar": "BYTES"}),
        ("max_pinned_bytes", parse_size, "host bytes a GPU backend may page-lock for DMA; 0 = half the machine's memory", "--max-pinned-bytes", {"minimum": 0, "metavar": "BYTES"}),
        ("device_queue_bytes", parse_size, "bytes of copies one session's ring worker keeps queued on a GPU's copy engine ahead of what it has done (a tenant streaming large copies cannot queue more in front of others); 0 = no bound", "--device-queue-bytes", {"minimum": 0, "metavar": "BYTES"}),
        ("max_device_bytes_per_session", parse_size, "device bytes one session may hold; 0 = unlimited", "--max-device-bytes-per-session", {"minimum": 0, "metavar": "BYTES"}),
        ("max_device_bytes", parse_size, "the whole daemon's device budget (numpy backend: host RAM)", "--max-device-bytes", {"minimum": 0, "metavar": "BYTES"}),
        ("max_inflight", _int, "requests one session may have queued or running (credits announced in hello)", "--max-inflight", {"minimum": 1}),
        ("max_sessions", _int, "sessions served at once (a hello beyond gets QuotaExceeded); 0 = sized from the fd limit (RLIMIT_NOFILE, raised to its hard limit at startup)", "--max-sessions", {"minimum": 0, "maximum": 1 << 20}),
        ("max_pass", _int, "requests one scheduler pass takes from a session", "--max-pass", {"minimum": 1}),
        ("max_reply_backlog", parse_size, "unread reply bytes the daemon parks for one client before it ends that session", "--max-reply-backlog", {"minimum": 1 << 16, "metavar": "BYTES"}),
        ("inline_bytes", parse_size, "data work touching at most this many bytes runs on the event loop, more on a worker thread (a checksum's bytes count half: it only reads them; a CPU device's kernels run in its process, never waited for on the loop)", "--inline-bytes", {"minimum": 0, "metavar": "BYTES"}),
        ("threads", _int, "worker threads for large copies", "--threads", {"minimum": 1, "maximum": 256}),
        ("placement", _str, "placement of host-only work: size, least-loaded, round-robin or cost", "--placement", {"choices": tuple(POLICIES)}),
        ("size_threshold", parse_size, "size placement: inputs below this many bytes go to a CPU device", "--size-threshold", {"minimum": 0, "metavar": "BYTES"}),
        ("shutdown_grace_s", _float, "seconds SIGTERM/SIGINT waits for queued work before releasing everything", "--shutdown-grace", {"minimum": 0, "metavar": "SECONDS"}),
        ("arena_ids", _int, "segment ids in each session's deferred-creation arena, per device (device buffers; remote segments take the home device's)", "--arena-ids", {"minimum": 1, "maximum": 1 << 22}),
        ("allow_remote_tcp", _bool, "bind insecure tcp on non-loopback addresses (with --curve-dir, any address is allowed)", "--allow-remote-tcp", {"boolean": True}),
        ("allow_insecure_tcp", _bool, "serve tcp without CURVE keys (tests on loopback; anyone who can connect gets a session)", "--allow-insecure-tcp", {"boolean": True}),
        ("curve_dir", _str, "CURVE keys from `transferd keygen DIR`: tcp clients must hold an authorized key", "--curve-dir", {"metavar": "DIR"}),
        ("rdma", _bool, "serve remote (NIXL) segments when NIXL is installed; its agent starts on first use", "--rdma", {"boolean": True}),
        ("remote_timeout_s", _float, "seconds one NIXL transfer may take before its requests fail", "--remote-timeout", {"minimum": 0.01, "metavar": "SECONDS"}),
        ("rings", _bool, "let same-host clients open a shared-memory request ring (docs/ring.md)", "--rings", {"boolean": True}),
        ("max_ring_capacity", _int, "largest request ring (descriptors) a session may open", "--max-ring-capacity", {"minimum": 2, "maximum": 1 << 20}),
        ("channel_port", _int, "TCP port for remote sessions' data channels (their rings, carried over TCP) on the host of the tcp endpoint; 0: any free port", "--channel-port", {"minimum": 0, "maximum": 65535, "metavar": "PORT"}),
        ("ring_spin_s", _float, "seconds the daemon busy-polls rings after the last ring request, before it sleeps", "--ring-spin", {"minimum": 0, "maximum": 0.1, "metavar": "SECONDS"}),
        ("ring_workers", _bool, "serve each ring's copies, fills, checksums and fences on a native worker thread (docs/ring.md)", "--ring-workers", {"boolean": True}),
        ("device_workers", _bool, "let the ring workers queue copies and fills that touch GPU memory through the CUDA driver (native/device.c); off: the Python pass serves them", "--device-workers", {"boolean": True}),
        ("worker_spin_s", _float, "seconds a ring's worker spins for the next descriptor before it sleeps on the futex", "--worker-spin", {"minimum": 0, "maximum": 0.01, "metavar": "SECONDS"}),
        ("copy_helpers", _int, "threads that share copies of 8 MiB or more with the ring workers, chunk by chunk, when idle; -1: the cores left when every ring's worker and client have one (at most 8); 0: none", "--copy-helpers", {"minimum": -1, "maximum": 8, "metavar": "N"}),
        ("worker_spin_spare_s", _float, "seconds a worker spins instead while every worker and its client can have a core (2 x workers <= cores); 0: --worker-spin", "--worker-spin-spare", {"minimum": 0, "maximum": 0.01, "metavar": "SECONDS"}),
        ("metrics_port", _int, "serve Prometheus metrics over HTTP on this port; 0 = off", "--metrics-port", {"minimum": 0, "maximum": 65535, "metavar": "PORT"}),
        ("metrics_addr", _str, "address the metrics endpoint binds", "--metrics-addr", {"metavar": "ADDR"}),
        ("metrics_connections", _int, "metrics HTTP connections at once (one more is answered 503 and closed; each is closed --metrics-timeout after accept)", "--metrics-connections", {"minimum": 1, "maximum": 4096, "metavar": "N"}),
        ("metrics_timeout_s", _float, "seconds a metrics HTTP connection may take, whatever it sends or reads, before it is closed", "--metrics-timeout", {"minimum": 0.05, "maximum": 3600, "metavar": "SECONDS"}),
        ("metrics_sessions", _int, "client names with per-session metric series of their own, the heaviest by bytes (the rest share client=\"(other)\"); 0 = none", "--metrics-sessions", {"minimum": 0, "maximum": 1024, "metavar": "N"}),
        ("limits.max_frame_bytes", parse_size, "largest request frame accepted", "--max-frame-bytes", {"minimum": 64, "maximum": 1 << 30, "metavar": "BYTES"}),
        ("limits.max_batch", _int, "requests per frame", "--max-batch", {"minimum": 1, "maximum": 1 << 24}),
        ("limits.max_vector", _int, "copies per vector request", "--max-vector", {"minimum": 1, "maximum": 1 << 24}),
        ("limits.max_str", _int, "longest string field", "--max-str", {"minimum": 256, "maximum": 1 << 20}),
        ("limits.max_bin", parse_size, "longest binary field (packed vectors)", "--max-bin", {"minimum": 1024, "maximum": 1 << 30, "metavar": "BYTES"}),
        ("log_level", lambda v: _str(v).upper(), "DEBUG, INFO, WARNING, ERROR", "--log-level", {"choices": ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), "default": "WARNING", "target": "process"}),
        ("log_json", _bool, "log one JSON object per line (ts, level, logger, msg, session)", "--log-json", {"default": False, "target": "process", "boolean": True}),
    ]
    out: list[Setting] = []
    covered: set[str] = set()
    for key, parse, help_, flag, extra in table:
        if key in covered:
            continue  # listed twice: the first entry wins
        extra = dict(extra)
        target = extra.setdefault("target", "limits" if key.startswith("limits.") else "daemon")
        owner = {"limits": lim, "daemon": d}.get(target)
        if owner is not None and not hasattr(owner, key.split(".")[-1]):
            continue  # the field left DaemonConfig / Limits
        default = extra.pop("default") if "default" in extra else getattr(owner, key.split(".")[-1])
        out.append(Setting(key, parse, default, help_, flag, **extra))
        covered.add(key)
    for f in dataclasses.fields(DaemonConfig):
        if f.name in covered or f.name == "limits":
            continue
        default = getattr(d, f.name)
        parse = _auto_parser(f.name, default)
        if parse is not None:
            out.append(Setting(f.name, parse, default, f.name.replace("_", " "), "--" + f.name.removesuffix("_s").replace("_", "-"), boolean=isinstance(default, bool)))
    for f in dataclasses.fields(Limits):
        key = f"limits.{f.name}"
        if key not in covered:
            out.append(Setting(key, _int, getattr(lim, f.name), f.name.replace("_", " "), "--" + f.name.replace("_", "-"), target="limits", minimum=1))
    return tuple(out)


SETTINGS: tuple[Setting, ...] = _defaults()
BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}


# --- resolution ------------------------------------------------------------------------------
@dataclass
class Resolved:
    """The effective settings: key -> value, and key -> where it came from."""

    values: dict[str, Any]
    sources: dict[str, str]
    config_file: Path | None = None

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def daemon_config(self) -> Any:
        from .protocol import Limits
        from .server._config import DaemonConfig

        kw = {s.field: self.values[s.key] for s in SETTINGS if s.target == "daemon"}
        lim = Limits(**{s.field: self.values[s.key] for s in SETTINGS if s.target == "limits"})
        return DaemonConfig(limits=lim, **kw)

    def to_toml(self) -> str:
        lines = ["# transferd effective configuration (each value's source in the comment)"]
        if self.config_file is not None:
            lines.append(f"# config file: {self.config_file}")
        tables: dict[str, list[str]] = {}
        for s in SETTINGS:
            table, _, name = s.key.rpartition(".")
            tables.setdefault(table, []).append(f"{name} = {_toml_value(self.values[s.key])}  # {self.sources[s.key]}")
        lines += tables.pop("")
        for table, body in tables.items():
            lines += ["", f"[{table}]", *body]
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        out = {s.key: {"value": _json_value(self.values[s.key]), "source": self.sources[s.key]} for s in SETTINGS}
        return json.dumps({"config_file": str(self.config_file) if self.config_file else None, "settings": out}, indent=2)


def _json_value(v: Any) -> Any:
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, tuple):
        return list(v)
    return v


def _toml_value(v: Any) -> str:
    v = _json_value(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def _flatten_file(doc: Mapping[str, Any], path: Path) -> dict[str, Any]:
    tables = {k.rpartition(".")[0] for k in BY_KEY if "." in k}
    flat: dict[str, Any] = {}
    for k, v in doc.items():
        if k in tables:
            if not isinstance(v, dict):
                raise ConfigError(f"{k} in {path}: must be a table ([{k}])")
            for sub, sv in v.items():
                full = f"{k}.{sub}"
                if full not in BY_KEY:
                    raise ConfigError(f"unknown key {full!r} in {path}")
                flat[full] = sv
        elif k in BY_KEY:
            flat[k] = v
        else:
            hint = f" (did you mean [limits] {k}?)" if f"limits.{k}" in BY_KEY else ""
            raise ConfigError(f"unknown key {k!r} in {path}{hint}")
    return flat


def load_file(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return _flatten_file(doc, path)


def resolve(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | str | None = None,
) -> Resolved:
    """Merge defaults < file < env < flags; validate every value and the cross-checks.

    `flags` maps setting keys to the raw values given on the command line
    (only those the user gave). `config_file` None means ``$TRANSFER_CONFIG`` if set.
    """
    env = os.environ if env is None else env
    flags = flags or {}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        values[s.key], sources[s.key] = s.default, "default"
    cfg_path: Path | None = None
    if config_file is None and env.get(ENV_PREFIX + "CONFIG"):
        config_file = env[ENV_PREFIX + "CONFIG"]
    if config_file is not None:
        cfg_path = Path(config_file)
        for key, raw in load_file(cfg_path).items():
            values[key] = _checked(BY_KEY[key], raw, f"file {cfg_path}")
            sources[key] = f"file {cfg_path}"
    for s in SETTINGS:
        if s.env in env:
            values[s.key] = _checked(s, env[s.env], f"env {s.env}")
            sources[s.key] = f"env {s.env}"
    for key, raw in flags.items():
        s = BY_KEY[key]
        values[key] = _checked(s, raw, f"flag {s.flag}")
        sources[key] = f"flag {s.flag}"
    r = Resolved(values, sources, cfg_path)
    _cross_check(r)
    return r


def _checked(s: Setting, raw: Any, origin: str) -> Any:
    try:
        return s.check(raw)
    except ValueError as exc:
        shown = raw if not isinstance(raw, (list, tuple)) else list(raw)
        raise ConfigError(f"{s.key} = {shown!r} from {origin}: {exc}") from None


def _cross_check(r: Resolved) -> None:
    def where(key: str) -> str:
        v = r[key]
        shown = _num(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)
        return f"{key} = {shown} from {r.sources[key]}"

    if r["session_timeout_s"] <= r["heartbeat_s"]:
        raise ConfigError(f"{where('session_timeout_s')}: must exceed {where('heartbeat_s')} (idle sessions would be reclaimed between pings)")
    if r["limits.max_bin"] > r["limits.max_frame_bytes"]:
        raise ConfigError(f"{where('limits.max_bin')}: must not exceed {where('limits.max_frame_bytes')}")
    for key in ("max_host_bytes", "max_host_bytes_per_session", "max_device_bytes", "max_device_bytes_per_session", "max_pinned_bytes",
                "device_queue_bytes"):
        if 0 < r[key] < 4096:  # (1.5K is 1536 bytes: less than the one page a segment takes)
            raise ConfigError(f"{where(key)}: a budget below one page (4 KiB) admits nothing; 0 means no limit "
                              "(sizes are bytes, or K/M/G/T binary multiples: 16G)")


# --- argparse glue -------------------------------------------------------------------------
def add_flags(p: argparse.ArgumentParser) -> None:
    """One flag per setting. Defaults are left unset so `flags_from_args` sees only what was given."""
    for s in SETTINGS:
        if s.key == "endpoints":
            shown = s.default[0]
        elif s.parse is parse_size and s.default:
            shown = fmt_bytes(s.default).replace(" ", "")  # 16GiB, as one writes it back
        else:
            shown = _json_value(s.default)
        extra = f" [env {s.env}; default {shown}]"
        if s.boolean:
            p.add_argument(s.flag, dest=s.dest, action=argparse.BooleanOptionalAction, default=None, help=s.help + extra)
        elif s.key == "endpoints":
            p.add_argument(s.flag, dest=s.dest, action="append", default=None, metavar=s.metavar, help=s.help + extra)
        else:
            metavar = s.metavar or ("N" if s.parse is _int else "{" + ",".join(s.choices) + "}" if s.choices else s.field.upper())
            p.add_argument(s.flag, dest=s.dest, default=None, metavar=metavar, help=s.help + extra)


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in SETTINGS:
        v = getattr(args, s.dest, None)
        if v is None:
            continue
        if s.key == "endpoints":
            v = ",".join(v)
        out[s.key] = v
    return out


# --- structured logs -----------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (UTC, RFC 3339), level, logger, msg; `session` when the
    record carries one (``log.info(..., extra={"session": sid})``); `exc` with a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        session = getattr(record, "session", None)
        if session is not None:
            out["session"] = session if isinstance(session, (int, str)) else getattr(session, "id", str(session))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(level: str = "WARNING", json_lines: bool = False, stream: Any = None) -> logging.Handler:
    """Configure the root logger for transferd (stderr by default); returns the handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if json_lines:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # The daemon's one startup line (version, endpoint, shm dir, backend, limits) shows at the
    # default level too; only ERROR and above silence it.
    startup = logging.getLogger("transfer.daemon.startup")
    chosen = logging.getLevelName(level.upper())
    startup.setLevel(logging.INFO if chosen <= logging.WARNING else chosen)
    return handler
