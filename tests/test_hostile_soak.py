"""The hostile-tenant soak (bench/hostile_soak.py), short: keeps the harness working in CI.

Runs ~14 s of the attacks today's daemon survives beside the two good clients, and
requires the soak's verdict: daemon alive and answering, good clients 100 %, no
violation, no leak (sessions, segments, device bytes, rings, shm files, fds, RSS,
processes), a clean SIGTERM exit. The attacks that break the daemon today are listed
in DISABLED with the reason; move one to ENABLED once its fix lands.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import hostile_soak

psutil = pytest.importorskip("psutil")

ENABLED = ["midkill", "ring", "forged_va", "fuzz", "hog", "churn", "compute"]  # rotation order
DISABLED = {
    "truncate_segment": "SIGBUS: the client truncates its segment's file (by the path RegisterHost returns, or the fd "
                        "behind its mapping) and the daemon's next copy from it kills the daemon (exit -7)",
    "truncate_ring": "SIGBUS: ftruncate of the ring file (the fd behind the client's mapping) kills the daemon (exit -7)",
    "compute_zero_stride": "wedge: Compute cast/sum over (2^30, 2^30) with strides (0, 0) passes the extent check "
                           "(4 bytes) and runs 2^60 elements on the event loop; nothing answers, SIGTERM does not stop it",
    "silent_flood": "SIGABRT: ~1,000 connections that never say hello exhaust RLIMIT_NOFILE=1024; libzmq aborts "
                    "with 'Too many open files (src/ipc_listener.cpp:297)'",
    "flood": "survives, but one process flooding unread Stats/Ping/Copy frames stalls the good client up to ~2.4 s "
             "(p99 ~0.9 s) and grows the daemon's RSS by 40-85 MiB: too noisy for a short pass/fail test",
}


def test_every_attack_is_either_run_or_disabled_with_a_reason() -> None:
    assert set(ENABLED) | set(DISABLED) == set(hostile_soak.ATTACKS)
    assert not set(ENABLED) & set(DISABLED)


def test_hostile_soak_short() -> None:
    cfg = hostile_soak.Config(seconds=14, procs=4, attacks=tuple(ENABLED), kill_every=4.0, episode=(1.0, 2.5), seed=1)
    res = hostile_soak.run(cfg)
    print("\n" + hostile_soak.table(res))
    assert res.ok, res.failures
    assert res.good["rounds"] > 50 and res.good["success_rate"] == 1.0
    assert {k for k, a in res.attacks.items() if a["episodes"]} == set(ENABLED)
    # On a loaded machine an episode can be SIGKILLed before it counted anything; most must have.
    ran = {k for k, a in res.attacks.items() if a["counts"]}
    assert len(ran) >= len(ENABLED) - 3, f"attacks that counted nothing: {set(ENABLED) - ran}"
