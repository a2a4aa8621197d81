"""Orchestration: processes per cell, synchronized repetitions, aggregation, cleanup."""

from __future__ import annotations

import contextlib
import glob
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import statistics
import tempfile
import uuid
from pathlib import Path
from collections.abc import Iterable
from typing import Any, Callable, cast

import numpy as np

from ._iceoryx import iox_prefix
from .channels import make_plumbing
from .common import HOST_DAEMON_ARGS, BenchFailure, Cell, Record, Spec, now
from .workers import consumer_main, producer_main

#: Seconds between sending "rep" and its synchronized start.
START_LEAD_S = 0.02


def transfer_available() -> tuple[bool, str]:
    try:
        import transfer
        from transfer.testing import run_daemon  # noqa: F401

        for name in ("connect", "checksum64"):
            if not hasattr(transfer, name):
                return False, f"transfer.{name} is missing"
    except Exception as e:  # noqa: BLE001
        return False, f"transfer core unavailable: {type(e).__name__}: {e}"
    return True, ""


def mode_available(mode: str) -> tuple[bool, str]:
    """Hooks for modes that need hardware or peers this run may not have."""
    if mode in ("local", "compute", "latency", "share"):
        return True, ""
    if mode == "gpu":
        from .gpu import available

        return available()
    if mode in ("remote", "registration"):
        # remote: the producer's own memory read over NIXL (UCX: cma/tcp on one host, RDMA
        # across hosts); the daemon stays the embedded ipc one, the data plane is NIXL's.
        # registration: a producer's memory registered with NIXL, and with the daemon.
        try:
            from transfer.transport import _nixl

            if not _nixl.available():
                return False, (f"{mode}: NIXL not importable "
                               "(pip install --no-deps nixl-cu12, see docs/rdma.md)")
        except Exception as e:  # noqa: BLE001
            return False, f"{mode}: NIXL wrapper unavailable ({type(e).__name__}: {e})"
        return True, ""
    return False, f"unknown mode {mode!r}"


class Runner:
    """Owns everything a run creates: temp dir, daemon, forkserver children, shm files."""

    def __init__(self, *, need_daemon: bool, reps: int, rep_s: float, warmup_s: float,
                 daemon_args: dict[str, Any] | None = None, tcp: bool = False) -> None:
        self.need_daemon = need_daemon
        #: Also serve tcp on loopback: the remote mode's producers connect as from another host.
        self.tcp = tcp
        self.tcp_endpoint: str | None = None
        self.reps = reps
        self.rep_s = rep_s
        self.warmup_s = warmup_s
        self.daemon_args = daemon_args or {}
        self.endpoint: str | None = None
        self.run_id = f"transfer-bench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._stack = contextlib.ExitStack()
        self._procs: list[mp.process.BaseProcess] = []
        self._eof: set[mpc.Connection] = set()
        self._inbox: dict[str, list[tuple[Any, ...]]] = {}  # messages that came early

    def __enter__(self) -> "Runner":
        try:
            self.run_dir = tempfile.mkdtemp(prefix="transfer-bench-")
            self._stack.callback(shutil.rmtree, self.run_dir, ignore_errors=True)
            self._stack.callback(self._remove_shm)
            self._stack.callback(self._reap)
            self.ctx = mp.get_context("forkserver")
            self.ctx.set_forkserver_preload(["numpy", "zmq", "transfer", "transfer._bench.workers"])
            if self.need_daemon:
                from transfer.testing import loopback_endpoint, run_daemon

                args = list(HOST_DAEMON_ARGS)
                if self.tcp:
                    self.tcp_endpoint = loopback_endpoint()
                    args += ["--endpoint", self.tcp_endpoint, "--allow-insecure-tcp"]  # loopback only
                # (its log to a file: its startup line would print through the live progress display)
                d = self._stack.enter_context(run_daemon(args, log=Path(self.run_dir) / "transferd.log", **self.daemon_args))
                self.endpoint = d.endpoint
                self.daemon_pid = getattr(d, "pid", None)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    # ------------------------------------------------------------------ cleanup

    def _remove_shm(self) -> None:
        # The run's own files, and iceoryx2's (named with a shorter prefix: channels.iox_prefix).
        for p in glob.glob(f"/dev/shm/{self.run_id}*") + glob.glob(f"/dev/shm/{iox_prefix(self.run_id)}*"):
            with contextlib.suppress(OSError):
                os.unlink(p)

    def _reap(self) -> None:
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs.clear()

    # ------------------------------------------------------------------ one cell

    def run_cell(self, cell: Cell, on_rep: Callable[[int, int], None] | None = None) -> Record:
        endpoint = self.tcp_endpoint if cell.mode == "remote" else self.endpoint
        cons_spec, prod_specs = make_plumbing(cell, self.ctx, self.run_dir, self.run_id, endpoint)
        workers: dict[str, tuple[mpc.Connection, mp.process.BaseProcess]] = {}
        try:
            if cons_spec is not None:
                workers["consumer"] = self._start(consumer_main, (cell, None, cons_spec))
            for i, spec in enumerate(prod_specs):
                workers[f"p{i}"] = self._start(producer_main, (i, cell, None, spec))
            _close_parent_copies([cons_spec, *prod_specs])
            self._collect(workers, set(workers), "ready", timeout=60)
            producers = sorted(k for k in workers if k.startswith("p"))
            total = 1 + self.reps
            reps: list[Record] = []
            for r in range(total):
                dur = self.warmup_s if r == 0 else self.rep_s
                t_start = now() + START_LEAD_S
                for k in producers:
                    workers[k][0].send(("rep", t_start, t_start + dur, cell.verify_every))
                got = self._collect(workers, set(producers), "rep", timeout=dur + 120)
                bad = {k: v["mismatches"] for k, v in got.items() if v["mismatches"]}
                if bad:
                    raise BenchFailure(f"checksum mismatch in {cell.describe()}: groups {bad}")
                if r > 0:
                    reps.append(_aggregate(list(got.values())))
                if on_rep:
                    on_rep(r + 1, total)
            for k in producers:
                workers[k][0].send(("stop",))
            self._collect(workers, set(producers), "bye", timeout=60)
            if "consumer" in workers:
                done = self._collect(workers, {"consumer"}, "done", timeout=60)["consumer"]
                if done["mismatches"]:
                    raise BenchFailure(f"checksum mismatch in {cell.describe()} (consumer): {done['mismatches'][:10]}")
            for _, p in workers.values():
                p.join(timeout=10)
        except BaseException:
            for _, p in workers.values():
                if p.is_alive():
                    p.terminate()
            raise
        finally:
            for conn, _ in workers.values():
                conn.close()
            self._reap()
            self._eof.clear()
            self._inbox.clear()
            self._remove_shm()
        return _summarize(cell, reps)

    def _start(self, target: Callable[..., None], args: tuple[Any, ...]) -> tuple[mpc.Connection, mp.process.BaseProcess]:
        parent, child = self.ctx.Pipe(duplex=True)
        args = tuple(child if a is None else a for a in args)
        p = self.ctx.Process(target=target, args=args, daemon=True)
        p.start()
        child.close()
        self._procs.append(p)
        return parent, p

    def _collect(self, workers: dict[str, tuple[mpc.Connection, mp.process.BaseProcess]], keys: set[str],
                 kind: str, timeout: float) -> dict[str, Any]:
        """Wait for message ``kind`` from every worker in ``keys``; fail fast on errors/deaths."""
        out: dict[str, Any] = {}
        deadline = now() + timeout
        for k in keys:
            pending = self._inbox.get(k)
            if pending:
                msg = pending.pop(0)
                if msg[0] != kind:
                    raise BenchFailure(f"unexpected message {msg[0]!r} from {k} while waiting for {kind!r}")
                out[k] = msg[1]
        by_conn = {workers[k][0]: k for k in workers if workers[k][0] not in self._eof}
        while len(out) < len(keys):
            left = deadline - now()
            if left <= 0:
                raise BenchFailure(f"timed out waiting for {kind!r} from {sorted(keys - set(out))}")
            ready = cast("list[mpc.Connection]", mpc.wait(list(by_conn), timeout=min(left, 0.5)))  # of by_conn
            for conn in ready:
                k = by_conn[conn]
                try:
                    msg = conn.recv()
                except EOFError:
                    del by_conn[conn]
                    self._eof.add(conn)
                    if k in keys and k not in out:
                        workers[k][1].join(timeout=1)
                        raise BenchFailure(f"worker {k} exited unexpectedly "
                                           f"(exit code {workers[k][1].exitcode})") from None
                    continue
                if msg[0] == "error":
                    raise BenchFailure(msg[1])
                if k not in keys or k in out:
                    self._inbox.setdefault(k, []).append(msg)
                    continue
                if msg[0] != kind:
                    raise BenchFailure(f"unexpected message {msg[0]!r} from {k} while waiting for {kind!r}")
                out[k] = msg[1]
            for k, (_, p) in workers.items():
                if k in keys and k not in out and not p.is_alive() and p.exitcode is not None:
                    conn = workers[k][0]
                    if not conn.poll(0):
                        raise BenchFailure(f"worker {k} died (exit code {p.exitcode})")
        return out


def _close_parent_copies(specs: Iterable[Spec | None]) -> None:
    """The coordinator keeps no ends of the data plumbing (so EOFs propagate)."""
    for spec in specs:
        if not spec:
            continue
        for v in spec.values():
            for obj in (v if isinstance(v, list) else [v]):
                if isinstance(obj, mpc.Connection):
                    obj.close()


def _aggregate(stats: list[Record]) -> Record:
    t0 = min(s["t_first"] for s in stats)
    t1 = max(s["t_last"] for s in stats)
    dt = max(t1 - t0, 1e-9)
    nbytes = sum(s["bytes"] for s in stats)
    items = sum(s["items"] for s in stats)
    lat = np.concatenate([s["lat"] for s in stats]) if stats else np.zeros(0)
    return {"gbps": nbytes / dt / 1e9, "rps": items / dt, "lat": lat, "bytes": nbytes,
            "seconds": dt, "verified_groups": sum(s["verified_groups"] for s in stats)}


def _summarize(cell: Cell, reps: list[Record]) -> Record:
    gb = [r["gbps"] for r in reps]
    rps = [r["rps"] for r in reps]
    lat = np.concatenate([r["lat"] for r in reps]) if reps else np.zeros(0)
    if not reps or sum(r["bytes"] for r in reps) == 0:
        raise BenchFailure(f"no data moved in {cell.describe()}")
    return {
        "method": cell.method, "mode": cell.mode, "size": cell.size, "producers": cell.producers,
        "depth": cell.depth, "batch": cell.batch,
        "gbps": statistics.median(gb), "rps": statistics.median(rps),
        "p50_us": float(np.percentile(lat, 50) * 1e6), "p99_us": float(np.percentile(lat, 99) * 1e6),
        "reps": len(reps), "min_gbps": min(gb), "max_gbps": max(gb),
        "groups": int(lat.size), "verified_groups": sum(r["verified_groups"] for r in reps),
        "verify_every": cell.verify_every,
    }
