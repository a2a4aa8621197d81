"""The hostile-tenant soak (bench/hostile_soak.py), short: keeps the harness working in CI.

Runs ~14 s of the attacks today's daemon and client survive beside the two good clients,
and requires the soak's verdict: daemon alive and answering, good clients 100 %, no
violation, no leak (sessions, segments, device bytes, rings, shm files, fds, RSS,
processes), a drain that serves the ring copies published before SIGTERM, a clean
SIGTERM exit. The attacks that find a bug not fixed yet (bench/hostile_soak.py BREAKING)
are listed in DISABLED with the reason; move one to ENABLED once its fix lands.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import hostile_soak

pytestmark = pytest.mark.slow  # (a soak: `pytest -m slow`, which CI runs after the default suite)

psutil = pytest.importorskip("psutil")

ENABLED = ["midkill", "ring", "forged_va", "fuzz", "hog", "churn", "compute", "compute_zero_stride",
           "truncate_segment", "truncate_ring", "silent_flood", "flood", "pid_extremes", "handover_flood",
           "metrics_flood", "squat", "fake_daemon", "fake_daemon_edges"]  # rotation order
#: Attacks left out of this short run, each with the reason (none today: every fix has landed).
DISABLED: dict[str, str] = {}


def test_the_disabled_attacks_are_the_soaks_breaking_ones() -> None:
    assert set(DISABLED) == set(hostile_soak.BREAKING)


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
