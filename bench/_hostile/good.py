"""The good client: steady, verified work beside the attackers.

Each round writes random bytes into its segment, moves them into a device buffer
(one copy, a copy_many of several pieces, a copy from a segment registered for this round
alone and freed after it, or a fill instead), sometimes fences, and checks the daemon's
checksum against `transfer.checksum64` of what was written;
every few rounds it also copies the buffer back and compares the bytes. Any
exception or wrong value is a failure. One line per round goes to a JSONL file:
`[wall time, ok, latency seconds, kind, error class or ""]`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

import transfer
from transfer import errors as E

from .tally import Tally, error_name

KINDS = ("copy", "copy_many", "fill", "fence", "segment")


def _round(c: transfer.Client, seg: transfer.HostSegment, back: transfer.HostSegment, buf: transfer.DeviceBuffer,
           rng: np.random.Generator, kind: str, cap: int, timeout: float, verify_back: bool) -> bool:
    n = int(rng.integers(1, cap))
    off = int(rng.integers(0, cap - n + 1))
    data = seg.ndarray((n,), np.uint8, offset=off)
    data[:] = rng.integers(0, 256, n, dtype=np.uint8)
    want = transfer.checksum64(data)
    if kind == "segment":  # its memfd is collected over the fd socket, where the handover floods are felt
        fresh = c.segment(n)
        try:
            fresh.ndarray((n,), np.uint8)[:] = data
            c.copy(buf.va, fresh.va, n)
            ok = bool(c.checksum(buf.va, n).result(timeout) == want)
        finally:
            c.free(fresh)
        return ok
    if kind == "copy":
        c.copy(buf.va, seg.va + off, n)
    elif kind == "copy_many":
        k = int(rng.integers(2, 9))
        cuts = np.unique(np.concatenate(([0, n], rng.integers(0, n, k - 1)))).astype(np.uint64)
        starts, sizes = cuts[:-1], np.diff(cuts)
        c.copy_many(buf.va + starts, seg.va + off + starts, sizes)
    elif kind == "fill":
        value = int(rng.integers(0, 256))
        c.fill(buf.va, n, value)
        want = transfer.checksum64(np.full(n, value, np.uint8))
    else:  # fence: a copy, then a fence that must see it done
        c.copy(buf.va, seg.va + off, n)
        c.fence(timeout=timeout)
    ok = c.checksum(buf.va, n).result(timeout) == want
    if ok and verify_back and kind != "fill":
        c.copy(back.va, buf.va, n)
        c.fence(timeout=timeout)
        ok = bool(np.array_equal(back.ndarray((n,), np.uint8), data))
    return ok


def good_client(endpoint: str, daemon_pid: int, out_dir: str, index: int, ring: bool, deadline: float,
                seed: int, cap: int = 256 << 10, pace: float = 0.002, timeout: float = 10.0,
                max_rounds: int = 1_000_000) -> None:
    """Runs until `deadline` (wall clock) or `max_rounds`; reconnects after a lost session."""
    out = Path(out_dir)
    tally = Tally(out / f"good-{index}.json", f"good-{'ring' if ring else 'socket'}")
    lines = open(out / f"good-{index}.jsonl", "w", buffering=1 << 16)  # noqa: SIM115 - closed below
    rng = np.random.default_rng(seed)
    last_flush = time.monotonic()
    try:
        rounds = 0
        while rounds < max_rounds and time.time() < deadline:
            try:
                c = transfer.connect(endpoint, name=f"good{index}", ring=ring, liveness_timeout=timeout)
            except E.TransferError as exc:
                tally.error(exc, "connect")
                lines.write(json.dumps([time.time(), False, 0.0, "connect", error_name(exc)]) + "\n")
                if not _alive(daemon_pid):
                    break
                time.sleep(0.5)
                continue
            tally.inc("sessions")
            try:
                seg, back = c.segment(cap), c.segment(cap)
                buf = c.alloc(cap)
                while rounds < max_rounds and time.time() < deadline:
                    rounds += 1
                    kind = KINDS[int(rng.integers(0, len(KINDS)))]
                    t0 = time.perf_counter()
                    err = ""
                    try:
                        ok = _round(c, seg, back, buf, rng, kind, cap, timeout, verify_back=rounds % 8 == 0)
                        if not ok:
                            err = "WrongChecksum"
                    except Exception as exc:  # noqa: BLE001 - every failure is counted, by class
                        ok, err = False, error_name(exc)
                    dt = time.perf_counter() - t0
                    lines.write(json.dumps([time.time(), ok, dt, kind, err]) + "\n")
                    tally.inc(f"{kind}:{'ok' if ok else 'fail'}")
                    if err:
                        tally.inc(f"fail:{err}")
                    if time.monotonic() - last_flush > 0.5:
                        lines.flush()
                        last_flush = time.monotonic()
                    lost = err in ("ConnectionLost", "RequestTimeout", "SessionClosed", "NoSession")
                    if err and (lost or isinstance(c._core.broken, BaseException)):
                        break  # the session is gone: reconnect
                    if pace:
                        time.sleep(pace)
            except E.TransferError as exc:
                tally.error(exc, "setup")
                lines.write(json.dumps([time.time(), False, 0.0, "setup", error_name(exc)]) + "\n")
            finally:
                try:
                    c.close()
                except Exception as exc:  # noqa: BLE001
                    tally.error(exc, "close")
            if not _alive(daemon_pid):
                break
    finally:
        lines.close()
        tally.flush(done=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
